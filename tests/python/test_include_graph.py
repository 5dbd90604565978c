"""The include graph of src/ stays as ARCHITECTURE.md draws it: each layer includes only
the layers before it (a model never knows how it is distributed, a kernel never knows
which model calls it, the trainer never launches a kernel), no file reaches itself
through its includes, and every quoted include names a file that exists."""
import os
import re
import unittest

from forge_test_util import source_dir

# The layers in order; each may include itself and the ones before it. ops/ dispatches to
# kernels/, which are the same layer's implementations and include only core/.
LAYERS = ["core", "kernels", "ops", "model", "distributed", "optim", "data", "ckpt", "train", "bench", "cli"]
INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"')


def include_graph(src):
    """{file relative to src: [(line number, included path)]} for every C++/CUDA file."""
    graph = {}
    for root, _, files in os.walk(src):
        for name in files:
            if not name.endswith((".h", ".cpp", ".cu", ".cuh")):
                continue
            path = os.path.join(root, name)
            includes = []
            with open(path, encoding="utf-8") as f:
                for number, line in enumerate(f, 1):
                    match = INCLUDE.match(line)
                    if match:
                        includes.append((number, match.group(1)))
            graph[os.path.relpath(path, src)] = includes
    return graph


def layer_of(path):
    return path.split("/", 1)[0]


class IncludeGraph(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.src = os.path.join(source_dir(), "src")
        cls.graph = include_graph(cls.src)

    def test_every_file_is_in_a_layer(self):
        for path in self.graph:
            self.assertIn(layer_of(path), LAYERS, f"src/{path} is in no layer of ARCHITECTURE.md")

    def test_every_include_exists(self):
        for path, includes in self.graph.items():
            for number, target in includes:
                here = os.path.join(self.src, os.path.dirname(path), target)
                self.assertTrue(os.path.exists(os.path.join(self.src, target)) or os.path.exists(here),
                                f"src/{path}:{number} includes \"{target}\", which does not exist")

    def test_layers_include_only_earlier_layers(self):
        violations = []
        for path, includes in self.graph.items():
            mine = LAYERS.index(layer_of(path))
            for number, target in includes:
                theirs = layer_of(target)
                if theirs in LAYERS and LAYERS.index(theirs) > mine:
                    violations.append(f"src/{path}:{number} includes \"{target}\": {layer_of(path)}/ may not "
                                      f"include {theirs}/")
        self.assertEqual(violations, [])

    def test_model_includes_nothing_from_distributed_or_train(self):
        for path, includes in self.graph.items():
            if layer_of(path) == "model":
                for number, target in includes:
                    self.assertNotIn(layer_of(target), ("distributed", "train"), f"src/{path}:{number}")

    def test_no_include_cycles(self):
        # Depth-first search over files; a back edge is a cycle.
        state, stack, cycles = {}, [], []

        def resolve(path, target):
            return target if target in self.graph else os.path.normpath(os.path.join(os.path.dirname(path), target))

        def visit(path):
            state[path] = "open"
            stack.append(path)
            for _, target in self.graph[path]:
                nxt = resolve(path, target)
                if nxt not in self.graph:
                    continue
                if state.get(nxt) == "open":
                    cycles.append(" -> ".join(stack[stack.index(nxt):] + [nxt]))
                elif nxt not in state:
                    visit(nxt)
            stack.pop()
            state[path] = "done"

        for path in sorted(self.graph):
            if path not in state:
                visit(path)
        self.assertEqual(cycles, [])


if __name__ == "__main__":
    unittest.main()
