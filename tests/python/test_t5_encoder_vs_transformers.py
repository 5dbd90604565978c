"""The CPU T5 encoder against transformers' T5EncoderModel in float64 on tiny random
configs, read from the folders save_pretrained writes (config.json and safetensors): the
last hidden state must agree within 1e-4 relative error. The configs vary the head count
and d_kv (an inner width other than d_model), the layer count, the relative-position
buckets and max_distance, with batches of several captions and sequences longer than
max_distance (the bins that share the last bucket). Every weight is drawn at random (norm
scales and the position bias table too). Also: the weights stored sharded, in bf16 and in
fp16 (forge reads the rounded values; transformers runs them upcast to float64), the
bucket function against T5Attention._relative_position_bucket over thousands of distances,
and refusals of configs and weight files that do not match."""
import json
import os
import subprocess
import unittest

import numpy as np
import torch
from safetensors.torch import load_file, save_file
from transformers import T5Config, T5EncoderModel
from transformers.models.t5.modeling_t5 import T5Attention

from forge_test_util import relative_error, run, scratch_dir, tool

TOLERANCE = 1e-4
REFERENCE = tool("forge_t5_reference")

BASE = dict(vocab_size=97, d_model=32, d_kv=8, num_heads=4, d_ff=48, num_layers=2, relative_attention_num_buckets=32,
            relative_attention_max_distance=128, feed_forward_proj="gated-gelu", batch=2, length=9)

CASES = [
    dict(name="v1_1_like"),
    dict(name="long_sequence", batch=1, length=150, num_layers=1, d_model=16, d_kv=4, d_ff=24),
    dict(name="few_buckets", relative_attention_num_buckets=8, relative_attention_max_distance=20, length=45,
         batch=3, num_heads=3, d_kv=6, d_model=24, num_layers=3),
    dict(name="inner_wider_than_model", d_model=16, d_kv=12, num_heads=2, d_ff=40, relative_attention_num_buckets=12,
         relative_attention_max_distance=9, length=30),
    dict(name="one_head_odd_buckets", num_heads=1, d_kv=5, d_model=12, d_ff=20, relative_attention_num_buckets=13,
         relative_attention_max_distance=40, batch=4, length=60),
]


def make_model(c, seed):
    config = T5Config(**{k: v for k, v in c.items() if k not in ("name", "batch", "length")}, dropout_rate=0.0)
    torch.manual_seed(seed)
    model = T5EncoderModel(config).double().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "layer_norm" in name:
                p.copy_(1.0 + 0.3 * torch.randn_like(p))
            elif "relative_attention_bias" in name or name in ("shared.weight", "encoder.embed_tokens.weight"):
                p.normal_(0.0, 1.0)
            else:
                p.normal_(0.0, 0.8 / p.shape[1] ** 0.5)
    return model


def forge_encode(model_dir, ids):
    d = scratch_dir()
    with open(os.path.join(d, "tokens.json"), "w") as f:
        json.dump({"batch": ids.shape[0], "length": ids.shape[1], "ids": ids.reshape(-1).tolist()}, f)
    run([REFERENCE, "encode", model_dir, d])
    out = np.fromfile(os.path.join(d, "out.bin"), dtype=np.float32)
    return out.reshape(ids.shape[0], ids.shape[1], -1)


def expected(model, ids):
    with torch.no_grad():
        return model(input_ids=torch.from_numpy(ids).long()).last_hidden_state.numpy()


def save(model, dtype=torch.float32, **kwargs):
    """A save_pretrained folder of the model's weights in `dtype`; the model keeps the
    stored values (rounded to `dtype`) in float64."""
    d = scratch_dir()
    model.to(dtype).save_pretrained(d, **kwargs)
    model.double()
    return d


class T5EncoderVsTransformers(unittest.TestCase):
    def test_cases(self):
        for i, case in enumerate(CASES):
            c = dict(BASE, **case)
            with self.subTest(c["name"]):
                model = make_model(c, seed=i)
                ids = np.random.RandomState(i).randint(0, c["vocab_size"], size=(c["batch"], c["length"]))
                # fp32 weights: transformers' float64 run on the same (fp32-rounded) values.
                model_dir = save(model)
                err = relative_error(forge_encode(model_dir, ids), expected(model, ids))
                self.assertLess(err, TOLERANCE, c["name"])

    def test_sharded_and_half_precision_files(self):
        c = dict(BASE, name="stored")
        ids = np.random.RandomState(5).randint(0, c["vocab_size"], size=(2, 20))
        for dtype, kwargs in [(torch.bfloat16, dict(max_shard_size="20KB")), (torch.float16, {})]:
            with self.subTest(str(dtype)):
                model = make_model(c, seed=11)
                model_dir = save(model, dtype, **kwargs)
                if "max_shard_size" in kwargs:
                    self.assertTrue(os.path.exists(os.path.join(model_dir, "model.safetensors.index.json")))
                # save() left the model holding the stored values, upcast.
                err = relative_error(forge_encode(model_dir, ids), expected(model, ids))
                self.assertLess(err, TOLERANCE, str(dtype))

    def test_pipeline_folder_and_embed_tokens_name(self):
        c = dict(BASE, name="pipeline")
        model = make_model(c, seed=3)
        ids = np.random.RandomState(3).randint(0, c["vocab_size"], size=(1, 12))
        root = scratch_dir()
        model.float().save_pretrained(os.path.join(root, "text_encoder_2"))
        model.double()
        self.assertLess(relative_error(forge_encode(root, ids), expected(model, ids)), TOLERANCE)
        # The tied embedding under its other name only.
        path = os.path.join(root, "text_encoder_2", "model.safetensors")
        tensors = load_file(path)
        tensors = {("encoder.embed_tokens.weight" if k == "shared.weight" else k): v for k, v in tensors.items()
                   if k != "encoder.embed_tokens.weight"}
        save_file(tensors, path, metadata={"format": "pt"})
        self.assertLess(relative_error(forge_encode(root, ids), expected(model, ids)), TOLERANCE)

    def test_buckets_match_transformers(self):
        for buckets, max_distance, n in [(32, 128, 5000), (8, 20, 300), (13, 40, 500), (64, 1000, 6000), (4, 2, 50),
                                         (100, 77, 2000)]:
            forge = json.loads(run([REFERENCE, "buckets", str(buckets), str(max_distance), str(n)]).stdout)
            torch_buckets = T5Attention._relative_position_bucket(torch.arange(-n, n + 1), bidirectional=True,
                                                                  num_buckets=buckets, max_distance=max_distance)
            self.assertEqual(forge, torch_buckets.tolist(), (buckets, max_distance))

    def test_refusals(self):
        model = make_model(dict(BASE), seed=1)
        for key, value, message in [
            ("feed_forward_proj", "relu", '"feed_forward_proj" is "relu"'),
            ("dense_act_fn", "gelu", '"dense_act_fn" is "gelu"'),
            ("is_gated_act", False, '"is_gated_act" is false'),
            ("model_type", "umt5", '"model_type" is "umt5"'),
            ("d_model", 0, '"d_model" is 0'),
            ("relative_attention_num_buckets", 2, "relative_attention_num_buckets must be at least 4"),
        ]:
            with self.subTest(key):
                d = save(model)
                with open(os.path.join(d, "config.json")) as f:
                    config = json.load(f)
                config[key] = value
                with open(os.path.join(d, "config.json"), "w") as f:
                    json.dump(config, f)
                result = self.refused(d)
                self.assertIn(message, result.stderr)
                self.assertIn("config.json", result.stderr)
        d = save(model)
        with open(os.path.join(d, "config.json")) as f:
            config = json.load(f)
        config["num_layers"] = 1  # the file holds a second block the config has no place for
        with open(os.path.join(d, "config.json"), "w") as f:
            json.dump(config, f)
        message = self.refused(d).stderr
        self.assertIn("model.safetensors: tensor 'encoder.block.1.", message)
        self.assertIn("has no place in the T5 encoder of 1 layers", message)
        config["num_layers"] = 3
        with open(os.path.join(d, "config.json"), "w") as f:
            json.dump(config, f)
        self.assertIn("no tensor 'encoder.block.2.layer.0.SelfAttention.q.weight'", self.refused(d).stderr)

    def refused(self, model_dir):
        d = scratch_dir()
        with open(os.path.join(d, "tokens.json"), "w") as f:
            json.dump({"batch": 1, "length": 1, "ids": [0]}, f)
        result = subprocess.run([REFERENCE, "encode", model_dir, d], capture_output=True, text=True)
        self.assertEqual(result.returncode, 1, result.stderr)
        return result


if __name__ == "__main__":
    unittest.main()
