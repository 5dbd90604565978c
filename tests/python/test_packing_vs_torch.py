"""Packed examples (NOTE [Packed examples]) in the CPU model against PyTorch: rows holding
several examples (attention confined to each, positions restarting, padding after) must
give, for every example, the logits transformers' Llama or Mistral computes for that
example alone, in float64; and the loss and every parameter's gradient of the packed rows
must equal those of the examples run one by one, within 1e-4 relative error."""
import json
import os
import unittest

import numpy as np
import torch
import torch.nn.functional as F

from forge_test_util import relative_error, run, scratch_dir, tool
from test_model_vs_torch import forge_config, hf_model

TOLERANCE = 1e-4

# Example lengths per row; -1 ends a row with padding.
CASES = [
    dict(name="gqa_packed", vocab_size=53, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
         ffn_hidden_size=40, batch=2, seq_len=16, rows=[[5, 7, 4], [9, -1]]),
    dict(name="window_packed", vocab_size=41, hidden_size=24, num_layers=2, num_heads=3, num_kv_heads=1,
         ffn_hidden_size=32, batch=2, seq_len=14, sliding_window=3, mistral=True, rows=[[1, 6, 3, -1], [14]]),
]


def segment_ids(case):
    ids = np.zeros((case["batch"], case["seq_len"]), dtype=np.int32)
    examples = []  # (row, first token, length)
    for r, lengths in enumerate(case["rows"]):
        at = 0
        for e, n in enumerate(lengths):
            if n < 0:
                ids[r, at:] = -1
                break
            ids[r, at:at + n] = e
            examples.append((r, at, n))
            at += n
    return ids, examples


class PackingVsTorch(unittest.TestCase):
    def check_case(self, case):
        torch.manual_seed(sum(map(ord, case["name"])))
        model = hf_model(case)
        state = dict(model.state_dict())
        if case.get("tie_word_embeddings"):
            state.pop("lm_head.weight", None)
        work = scratch_dir()
        with open(os.path.join(work, "config.json"), "w") as f:
            json.dump(forge_config(case), f)
        run([tool("forge_model_reference"), "specs", work])
        with open(os.path.join(work, "specs.json")) as f:
            specs = json.load(f)
        flat = [torch.cat([state[name] for name in spec["hf_names"]], dim=0).reshape(-1) for spec in specs]
        np.concatenate([t.numpy() for t in flat]).astype(np.float32).tofile(os.path.join(work, "weights.bin"))

        b, s, v = case["batch"], case["seq_len"], case["vocab_size"]
        ids, examples = segment_ids(case)
        tokens = torch.randint(0, v, (b, s), dtype=torch.int32)
        targets = torch.randint(0, v, (b, s), dtype=torch.int32)
        targets[torch.from_numpy(ids) < 0] = -100
        for r, first, n in examples:
            targets[r, first + n - 1] = -100  # never across an example's end
        tokens.numpy().tofile(os.path.join(work, "tokens.bin"))
        targets.numpy().tofile(os.path.join(work, "targets.bin"))
        ids.tofile(os.path.join(work, "segments.bin"))
        run([tool("forge_model_reference"), "run", work])

        # The reference: each example alone, the same fp32 weights in float64.
        with torch.no_grad():
            for p in model.parameters():
                p.copy_(p.float().double())
        model.zero_grad()
        forge_logits = np.fromfile(os.path.join(work, "logits.bin"), dtype=np.float32).reshape(b, s, v)
        count = int((targets != -100).sum())
        total = 0.0
        for r, first, n in examples:
            logits = model(input_ids=tokens[r:r + 1, first:first + n].long()).logits[0]
            err = relative_error(forge_logits[r, first:first + n].astype(np.float64), logits.detach().numpy())
            self.assertLess(err, TOLERANCE, f"logits of the example at row {r} token {first}")
            loss = F.cross_entropy(logits, targets[r, first:first + n].long(), ignore_index=-100, reduction="sum")
            (loss / count).backward()
            total += loss.item()
        with open(os.path.join(work, "loss.json")) as f:
            forge_loss = json.load(f)
        self.assertEqual(forge_loss["tokens"], count)
        self.assertAlmostEqual(forge_loss["loss"], total / count, delta=TOLERANCE * total / count)

        grads = dict((n, p.grad) for n, p in model.named_parameters())
        forge_grads = np.fromfile(os.path.join(work, "grads.bin"), dtype=np.float32).astype(np.float64)
        offset = 0
        for spec in specs:
            n = int(np.prod(spec["shape"]))
            ref = torch.cat([grads[name] for name in spec["hf_names"]], dim=0).reshape(-1).numpy()
            err = relative_error(forge_grads[offset:offset + n], ref)
            offset += n
            print(f"{case['name']}: {spec['name']:32s} grad rel err {err:.2e}")
            self.assertLess(err, TOLERANCE, spec["name"])

    def test_cases(self):
        for case in CASES:
            with self.subTest(case["name"]):
                self.check_case(case)


if __name__ == "__main__":
    unittest.main()
