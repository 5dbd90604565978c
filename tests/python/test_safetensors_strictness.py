"""forge's safetensors reader accepts exactly the headers the reference reader (the
safetensors package, Rust's serde_json underneath) accepts: whitespace around the JSON is
allowed, NUL padding, a byte-order mark or trailing bytes are not (NOTE [Strict safetensors
parsing])."""
import os
import struct
import sys

import safetensors.numpy

from forge_test_util import run, scratch_dir, tool

TENSOR = b'"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}'
BODY = b"{" + TENSOR + b"}"

HEADERS = {
    "plain": BODY,
    "trailing spaces": BODY + b"    ",
    "trailing newline": BODY + b"\n",
    "trailing tab and carriage return": BODY + b"\t\r",
    "leading space": b" " + BODY,
    "leading newline": b"\n" + BODY,
    "trailing NUL padding": BODY + b"\0\0\0",
    "NUL then garbage": BODY + b"\0garbage",
    "NUL inside": b"{" + TENSOR + b"\0}",
    "trailing garbage": BODY + b"x",
    "byte-order mark": b"\xef\xbb\xbf" + BODY,
    "two objects": BODY + BODY,
    "not an object": b"[" + BODY + b"]",
    "deeply nested metadata": b'{"__metadata__":' + b"[" * 100000 + b"]" * 100000 + b"," + TENSOR + b"}",
    "number out of range": b'{"__metadata__":{"x":1e400},' + TENSOR + b"}",
}


def reference_accepts(path):
    try:
        safetensors.numpy.load_file(path)
        return True
    except Exception:  # the reference raises SafetensorError (and others) for a bad header
        return False


def main():
    directory = scratch_dir()
    paths = []
    for i, header in enumerate(HEADERS.values()):
        path = os.path.join(directory, f"case{i}.safetensors")
        with open(path, "wb") as f:
            f.write(struct.pack("<Q", len(header)) + header + b"\0\0\0\0")
        paths.append(path)
    verdicts = run([tool("forge_read_safetensors")] + paths).stdout.splitlines()
    failures = []
    for (name, _), path, verdict in zip(HEADERS.items(), paths, verdicts):
        expected = reference_accepts(path)
        accepted = verdict == "accept"
        print(f"{name:34} reference {'accepts' if expected else 'rejects'}, forge: {verdict[:100]}")
        if accepted != expected:
            failures.append(name)
    if len(verdicts) != len(paths):
        failures.append(f"{len(verdicts)} verdicts for {len(paths)} files")
    if failures:
        print("forge disagrees with the reference reader on:", ", ".join(failures))
        sys.exit(1)


if __name__ == "__main__":
    main()
