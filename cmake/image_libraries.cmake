# NOTE [Image libraries]
# forge decodes JPEG, PNG and WebP through libjpeg-turbo's libjpeg API, libpng and libwebp
# (src/data/image_*.cpp), found by pkg-config as libjpeg, libpng and libwebp (Debian's
# libjpeg-dev, libpng-dev and libwebp-dev, which scripts/install-deps installs). The GPU
# machines have no -dev packages and nothing can be installed there: scripts/device-deps
# unpacks Debian 12's packages of the three (headers, the .so links and the shared
# libraries themselves, which need only glibc, libm and zlib) into .deps/images, and for
# each library pkg-config does not find, CMake takes it from there. It is linked by its full
# path, so CMake puts .deps/images/usr/lib/<arch> into the RUNPATH of the binaries in the
# build tree and they load those copies wherever they run from. The three come from one place:
# pkg-config when it knows all three, else .deps for all three — a mix puts .deps/images's
# headers (libjpeg 6.2's jpeglib.h among them) before the system's and its libraries in the
# RUNPATH before the system's, so a system libjpeg 8 would run behind Debian's 6.2 header (on
# the GPU machine, whose Ubuntu has libjpeg and libpng's .pc files but not libwebp's, JPEG
# decoding then failed with "Wrong JPEG library version"). -DFORGE_IMAGE_LIBS_FROM_DEPS=ON takes
# all three from .deps even where pkg-config finds them (to try that path on any machine).
set(FORGE_IMAGE_DEPS_DIR "${CMAKE_CURRENT_SOURCE_DIR}/.deps/images" CACHE PATH
    "Where scripts/device-deps unpacks libjpeg, libpng and libwebp for machines without their -dev packages")
option(FORGE_IMAGE_LIBS_FROM_DEPS "Take libjpeg, libpng and libwebp from FORGE_IMAGE_DEPS_DIR, not pkg-config" OFF)

set(FORGE_IMAGE_LIBRARIES)
set(forge_image_from_deps ${FORGE_IMAGE_LIBS_FROM_DEPS})
if(NOT forge_image_from_deps)
  foreach(module libjpeg libpng libwebp)
    pkg_check_modules(forge_probe_${module} QUIET ${module})
    if(NOT forge_probe_${module}_FOUND)
      message(STATUS "${module}: pkg-config knows none; libjpeg, libpng and libwebp all from .deps/images")
      set(forge_image_from_deps ON)
    endif()
  endforeach()
endif()
function(forge_find_image_library name module header library debian_package)
  if(NOT forge_image_from_deps)
    pkg_check_modules(FORGE_${name} QUIET IMPORTED_TARGET ${module})
    if(FORGE_${name}_FOUND)
      message(STATUS "${module} ${FORGE_${name}_VERSION}: pkg-config")
      set(FORGE_IMAGE_LIBRARIES ${FORGE_IMAGE_LIBRARIES} PkgConfig::FORGE_${name} PARENT_SCOPE)
      return()
    endif()
  endif()
  set(root "${FORGE_IMAGE_DEPS_DIR}/usr")
  find_path(FORGE_${name}_DEPS_INCLUDE ${header} PATHS "${root}/include/libpng16" "${root}/include" NO_DEFAULT_PATH)
  find_library(FORGE_${name}_DEPS_LIBRARY ${library} PATHS "${root}/lib/${CMAKE_LIBRARY_ARCHITECTURE}" "${root}/lib"
               NO_DEFAULT_PATH)
  if(NOT FORGE_${name}_DEPS_INCLUDE OR NOT FORGE_${name}_DEPS_LIBRARY)
    message(FATAL_ERROR "${module} not found: pkg-config knows no ${module}, and ${FORGE_IMAGE_DEPS_DIR} holds no "
                        "${header} and lib${library}.so. Install ${debian_package} (scripts/install-deps), or unpack "
                        "a copy into .deps/images with scripts/device-deps.")
  endif()
  set(includes "${FORGE_${name}_DEPS_INCLUDE}")
  if(EXISTS "${root}/include/${CMAKE_LIBRARY_ARCHITECTURE}")
    list(APPEND includes "${root}/include/${CMAKE_LIBRARY_ARCHITECTURE}")  # libjpeg's jconfig.h
  endif()
  add_library(forge_image_${name} SHARED IMPORTED)
  set_target_properties(forge_image_${name} PROPERTIES IMPORTED_LOCATION "${FORGE_${name}_DEPS_LIBRARY}"
                                                       INTERFACE_INCLUDE_DIRECTORIES "${includes}")
  message(STATUS "${module}: ${FORGE_${name}_DEPS_LIBRARY} (from ${FORGE_IMAGE_DEPS_DIR})")
  set(FORGE_IMAGE_LIBRARIES ${FORGE_IMAGE_LIBRARIES} forge_image_${name} PARENT_SCOPE)
endfunction()

forge_find_image_library(JPEG libjpeg jpeglib.h jpeg libjpeg-dev)
forge_find_image_library(PNG libpng png.h png16 libpng-dev)
forge_find_image_library(WEBP libwebp webp/decode.h webp libwebp-dev)
