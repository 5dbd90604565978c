"""Shared helpers for the Python reference tests: where the forge binaries are, a scratch
directory per test, a run's losses, and the relative-error measure the tests use."""
import atexit
import json
import os
import shlex
import shutil
import subprocess
import tempfile


def tool(name):
    return os.path.join(os.environ["FORGE_TOOLS_DIR"], name)


def forge_bin():
    return os.environ["FORGE_BIN"]


def source_dir():
    return os.environ["FORGE_SOURCE_DIR"]


def run(args, **kwargs):
    result = subprocess.run(args, capture_output=True, text=True, **kwargs)
    if result.returncode != 0:
        raise AssertionError(f"{args} exited {result.returncode}\nstdout:\n{result.stdout}\nstderr:\n{result.stderr}")
    return result


def scratch_dir():
    """A fresh directory, removed when the test process exits (kept when FORGE_KEEP_TEST_DIRS
    is set, to look at a failure)."""
    path = tempfile.mkdtemp(prefix="forge-test-")
    if not os.environ.get("FORGE_KEEP_TEST_DIRS"):
        atexit.register(shutil.rmtree, path, ignore_errors=True)
    return path


def relative_error(actual, expected):
    """max |actual - expected| / max |expected| (0 when both are 0)."""
    scale = float(abs(expected).max())
    diff = float(abs(actual - expected).max())
    return diff / scale if scale > 0 else diff


def records(run_dir, kind="train"):
    """The records of RUN_DIR/metrics.jsonl whose type is KIND ("train", "eval", "run", ...)."""
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [r for r in map(json.loads, f) if r["type"] == kind]


def train_losses(run_dir):
    """Loss per step of RUN_DIR/metrics.jsonl; a resumed run re-logs the steps after its
    checkpoint, the last wins."""
    by_step = {}
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        for record in map(json.loads, f):
            if record["type"] == "train":
                by_step[record["step"]] = record["loss"]
    return [by_step[s] for s in sorted(by_step)]


def train_on_ranks(run_dir, ranks, data_ranks, *overrides, steps=30, check=True, timeout=300):
    """forge train for STEPS steps on RANKS CPU ranks (forge launch; one rank runs alone),
    micro-batch 2 and the accumulation that fills a global batch of 8 sequences over
    DATA_RANKS data-parallel ranks, evaluating every 10 steps: the same run at every layout
    of the parallelism tests."""
    accum = 8 // (2 * data_ranks)
    args = ["train", "--training.steps", str(steps), "--training.local_batch_size", "2",
            "--training.gradient_accumulation_steps", str(accum), "--eval.interval", "10",
            "--logging.run_dir", run_dir, *overrides]
    command = [forge_bin(), "launch", "--nproc-per-node", str(ranks), "--", *args] if ranks > 1 else [forge_bin(), *args]
    env = dict(os.environ, FORGE_NUM_THREADS="1")
    result = subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=env)
    if check and result.returncode != 0:
        raise AssertionError(f"{command} exited {result.returncode}\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}")
    return result


def train_with_nan_on_rank_one(run_dir, nan_spec, *overrides, steps=4):
    """forge train for STEPS steps on 2 CPU ranks (micro-batch 2, 4 per step, no evaluation)
    with FORGE_TEST_INJECT_NAN=NAN_SPEC on rank 1 alone: the finished process."""
    script = (f'if [ "$RANK" = 1 ]; then export FORGE_TEST_INJECT_NAN={shlex.quote(nan_spec)}; fi; '
              f'exec {shlex.quote(forge_bin())} "$@"')
    args = ["train", "--training.steps", str(steps), "--training.local_batch_size", "2",
            "--training.gradient_accumulation_steps", "4", "--eval.interval", "0", "--logging.run_dir", run_dir,
            *overrides]
    return subprocess.run([forge_bin(), "launch", "--nproc-per-node", "2", "--", "sh", "-c", script, "sh", *args],
                          capture_output=True, text=True, timeout=300, env=dict(os.environ, FORGE_NUM_THREADS="1"))


def max_relative_difference(a, b, key):
    """max |a[i][key] - b[i][key]| / |b[i][key]| over two runs' records, step by step."""
    assert len(a) == len(b) and a, (len(a), len(b))
    return max(abs(x[key] - y[key]) / abs(y[key]) for x, y in zip(a, b))



def resumed_copy(source, run_dir, ranks, data_ranks, *overrides, steps=30, check=True):
    """A copy of SOURCE (a train_on_ranks run that saved every steps/2 steps) at RUN_DIR,
    resumed from its middle checkpoint on RANKS ranks: the run's result and the train and
    eval records it appended."""
    shutil.copytree(source, run_dir)
    half = str(steps // 2)
    result = train_on_ranks(run_dir, ranks, data_ranks, *overrides, "--checkpoint.enable", "true",
                            "--checkpoint.interval", half, "--checkpoint.load_step", half, steps=steps, check=check)
    return result, records(run_dir, "train")[steps:], records(run_dir, "eval")[3:]


def expect_moe_run_follows(test, run, one, steps, tolerance, export=True):
    """A Mixture-of-Experts run RUN on several ranks against ONE's on one: the losses,
    gradient norms and validation losses within TOLERANCE, the first 5 steps' expert loads
    equal, the final checkpoint's weights and (with EXPORT) the Hugging Face export within
    1e-5."""
    import numpy
    from safetensors.numpy import load_file
    from test_fsdp import checkpoint_weights
    for kind, key in (("train", "loss"), ("train", "grad_norm"), ("eval", "loss")):
        gap = max_relative_difference(records(run, kind), records(one, kind), key)
        print(f"{os.path.basename(run)} {kind} {key}: {gap:.2e}")
        test.assertLess(gap, tolerance, key)
    test.assertEqual([r["expert_load"] for r in records(run, "train")][:5],
                     [r["expert_load"] for r in records(one, "train")][:5])
    gap = float(numpy.abs(checkpoint_weights(run, steps) - checkpoint_weights(one, steps)).max())
    print(f"{os.path.basename(run)} final weights: {gap:.2e}")
    test.assertLess(gap, 1e-5)
    if not export:
        return
    mine, theirs = (load_file(os.path.join(d, "hf", "model.safetensors")) for d in (run, one))
    test.assertEqual(mine.keys(), theirs.keys())
    gap = max(float(numpy.abs(mine[name] - value).max()) for name, value in theirs.items())
    print(f"{os.path.basename(run)} Hugging Face export: {gap:.2e}")
    test.assertLess(gap, 1e-5)


def expect_resumes_under_layouts(test, tmp, prefix, flags, cases, tolerance, steps=30):
    """Each case (name, source run under TMP, ranks, data_ranks, layout flags, the "saved by
    N ranks" line the resume logs) copies its source and resumes it from the middle
    checkpoint under the layout: steps steps/2 + 1 .. steps are the source's within TOLERANCE.
    The copies keep the source's first two evaluations, so the resumed ones start at [2:]."""
    for name, source, ranks, data_ranks, layout, saved_by in cases:
        with test.subTest(model=prefix, run=name):
            source = os.path.join(tmp, source)
            resumed = os.path.join(tmp, f"{prefix}-{name.replace(' ', '-')}")
            result, resumed_train, _ = resumed_copy(source, resumed, ranks, data_ranks, *flags, *layout, steps=steps)
            test.assertIn(saved_by, result.stdout + result.stderr)
            expect_continues(test, source, resumed_train, records(resumed, "eval")[2:], tolerance, steps=steps)


def expect_continues(test, source, resumed_train, resumed_eval, tolerance, steps=30):
    """The resumed steps steps/2 + 1 .. steps are SOURCE's uninterrupted ones: bitwise
    (tolerance 0) or within fp32 reordering."""
    half = steps // 2
    test.assertEqual([r["step"] for r in resumed_train], list(range(half + 1, steps + 1)))
    for got, want, key in ((resumed_train, records(source, "train")[half:], "loss"),
                           (resumed_train, records(source, "train")[half:], "grad_norm"),
                           (resumed_eval, records(source, "eval")[1:], "loss")):
        if tolerance == 0:
            test.assertEqual([r[key] for r in got], [r[key] for r in want], key)
        else:
            test.assertLess(max_relative_difference(got, want, key), tolerance, key)
