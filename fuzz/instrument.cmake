# NOTE [Fuzz build]
# With -DFORGE_FUZZ=ON (in a build directory of its own: scripts/fuzz uses build-fuzz),
# forge_lib and the harnesses of fuzz/ are compiled by clang with libFuzzer's coverage
# instrumentation, AddressSanitizer and UndefinedBehaviorSanitizer (every UBSan report
# aborts, so a fuzzer counts it as a crash). The harnesses must also run on machines
# without clang or forge's -dev packages (the GPU machines run the long campaign from
# prebuilt binaries), so they link everything they can statically: the sanitizer and
# libFuzzer runtimes (clang's default), libstdc++ and libgcc, and the .a archives of
# yaml-cpp, PCRE2, zlib and zstd. Debian ships no libfmt.a, and fmt header-only makes
# every file compile 40% longer, so libfmt.so.9 is the one shared library besides glibc
# (it needs libstdc++.so.6 and libgcc_s.so.1 itself: every machine with g++ has them):
# scripts/fuzz --package copies it beside the binaries, which look there first ($ORIGIN).
# The static archives are not instrumented: the fuzzer sees coverage of forge's own code.
# FORGE_FUZZ_OPT is -O0 by default: CI builds and fuzzes within minutes on two cores,
# and -O1 compiles 1.7 times longer (faster harnesses for long campaigns; not measured yet).
# forge_lib is built here from the parsers' layers only (FORGE_FUZZ_SOURCES; the CPU ops
# come with the model's parameter layout, which checkpoints are checked against):
# compiling all of it instrumented takes CI's two cores too long. A parser that comes to
# need a file of another layer fails to link here, and that file is added below.
if(FORGE_CUDA)
  message(FATAL_ERROR "FORGE_FUZZ builds the CPU library only: configure it without FORGE_CUDA")
endif()
if(NOT CMAKE_CXX_COMPILER_ID MATCHES "Clang")
  message(FATAL_ERROR "FORGE_FUZZ needs clang (libFuzzer): configure with -DCMAKE_CXX_COMPILER=clang++")
endif()
set(FORGE_BUILD_TESTS OFF CACHE BOOL "Build the tests" FORCE)
set(FORGE_FUZZ_OPT -O0 CACHE STRING "Optimization flag of the fuzz build")
set(FORGE_FUZZ_FLAGS -fsanitize=address,undefined -fno-sanitize-recover=all -fno-omit-frame-pointer -g ${FORGE_FUZZ_OPT})
add_compile_options(-fsanitize=fuzzer-no-link ${FORGE_FUZZ_FLAGS})
add_link_options(${FORGE_FUZZ_FLAGS} -static-libstdc++ -static-libgcc)

set(FORGE_FUZZ_LIBRARIES fmt::fmt)
foreach(archive yaml-cpp pcre2-8 zstd z)
  find_library(FORGE_FUZZ_${archive}_ARCHIVE NAMES lib${archive}.a REQUIRED)
  list(APPEND FORGE_FUZZ_LIBRARIES ${FORGE_FUZZ_${archive}_ARCHIVE})
endforeach()

set(FORGE_FUZZ_SOURCES)
foreach(layer core ops kernels/cpu model data ckpt)
  file(GLOB layer_sources CONFIGURE_DEPENDS ${CMAKE_CURRENT_SOURCE_DIR}/src/${layer}/*.cpp)
  list(APPEND FORGE_FUZZ_SOURCES ${layer_sources})
endforeach()
# The data layer's dataset building (no parser of its own) is left out; data_loader.cpp stays
# (TokenDataset's default sample_examples, which every dataset's vtable refers to).
foreach(source dataset_prep generated_datasets make_dataset markov_source packed_dataset prep_pipeline)
  list(REMOVE_ITEM FORGE_FUZZ_SOURCES ${CMAKE_CURRENT_SOURCE_DIR}/src/data/${source}.cpp)
endforeach()
file(GLOB config_sources CONFIGURE_DEPENDS ${CMAKE_CURRENT_SOURCE_DIR}/src/cli/config_*.cpp)
list(APPEND FORGE_FUZZ_SOURCES ${config_sources})
foreach(source distributed/launch_env distributed/slurm_lists optim/config_rules)
  list(APPEND FORGE_FUZZ_SOURCES ${CMAKE_CURRENT_SOURCE_DIR}/src/${source}.cpp)
endforeach()
