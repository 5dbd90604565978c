"""forge prep --format sft against transformers' apply_chat_template, token for token.

Tokenizers are trained locally (tokenizer_fixtures.py): a Llama 3-style byte-level BPE with
<|start_header_id|> / <|end_header_id|> / <|eot_id|> added, and a Llama 2-style
SentencePiece BPE (<s>, </s>; Prepend/Replace normalizer for llama2, Metaspace for
mistral). Each gets a tokenizer_config.json holding the model family's official chat
template (written below as data) and forge prep runs with --chat-template auto, so the
recognition of the official sources is exercised too. For every example:
  - the ids forge writes equal apply_chat_template(messages, tokenize=True);
  - the mask is 1 exactly on the assistant responses, derived independently by rendering
    prefixes with transformers: an assistant turn i spans the tokens from
    len(render(messages[:i], add_generation_prompt=True)) to len(render(messages[:i+1]))
    (none of these templates marks {% generation %}, so return_assistant_tokens_mask
    cannot be used);
  - --train-on last keeps only the last turn; prompt/completion and Alpaca lines are one
    user/assistant turn; --chat-template none gives prompt + completion + EOS; the Alpaca
    prompt is Stanford Alpaca's text; --prepend-bos never doubles the template's BOS.
"""
import json
import os
import shutil
import subprocess
import sys
import unittest

import numpy as np

sys.path.insert(0, os.path.dirname(__file__))
import forge_test_util  # noqa: E402
import tokenizer_fixtures as fixtures  # noqa: E402

# meta-llama/Llama-3.1-8B-Instruct's tokenizer_config.json "chat_template" (shared by
# Llama-3.1-70B-Instruct and Llama-3.3-70B-Instruct).
LLAMA3_TEMPLATE = r'''{{- bos_token }}
{%- if custom_tools is defined %}
    {%- set tools = custom_tools %}
{%- endif %}
{%- if not tools_in_user_message is defined %}
    {%- set tools_in_user_message = true %}
{%- endif %}
{%- if not date_string is defined %}
    {%- set date_string = "26 Jul 2024" %}
{%- endif %}
{%- if not tools is defined %}
    {%- set tools = none %}
{%- endif %}

{#- This block extracts the system message, so we can slot it into the right place. #}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content']|trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = "" %}
{%- endif %}

{#- System message + builtin tools #}
{{- "<|start_header_id|>system<|end_header_id|>\n\n" }}
{%- if builtin_tools is defined or tools is not none %}
    {{- "Environment: ipython\n" }}
{%- endif %}
{%- if builtin_tools is defined %}
    {{- "Tools: " + builtin_tools | reject('equalto', 'code_interpreter') | join(", ") + "\n\n"}}
{%- endif %}
{{- "Cutting Knowledge Date: December 2023\n" }}
{{- "Today Date: " + date_string + "\n\n" }}
{%- if tools is not none and not tools_in_user_message %}
    {{- "You have access to the following functions. To call a function, please respond with JSON for a function call." }}
    {{- 'Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}.' }}
    {{- "Do not use variables.\n\n" }}
    {%- for t in tools %}
        {{- t | tojson(indent=4) }}
        {{- "\n\n" }}
    {%- endfor %}
{%- endif %}
{{- system_message }}
{{- "<|eot_id|>" }}

{#- Custom tools are passed in a user message with some extra guidance #}
{%- if tools_in_user_message and not tools is none %}
    {#- Extract the first user message so we can plug it in here #}
    {%- if messages | length != 0 %}
        {%- set first_user_message = messages[0]['content']|trim %}
        {%- set messages = messages[1:] %}
    {%- else %}
        {{- raise_exception("Cannot put tools in the first user message when there's no first user message!") }}
{%- endif %}
    {{- '<|start_header_id|>user<|end_header_id|>\n\n' -}}
    {{- "Given the following functions, please respond with a JSON for a function call " }}
    {{- "with its proper arguments that best answers the given prompt.\n\n" }}
    {{- 'Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}.' }}
    {{- "Do not use variables.\n\n" }}
    {%- for t in tools %}
        {{- t | tojson(indent=4) }}
        {{- "\n\n" }}
    {%- endfor %}
    {{- first_user_message + "<|eot_id|>"}}
{%- endif %}

{%- for message in messages %}
    {%- if not (message.role == 'ipython' or message.role == 'tool' or 'tool_calls' in message) %}
        {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + '<|eot_id|>' }}
    {%- elif 'tool_calls' in message %}
        {%- if not message.tool_calls|length == 1 %}
            {{- raise_exception("This model only supports single tool-calls at once!") }}
        {%- endif %}
        {%- set tool_call = message.tool_calls[0].function %}
        {%- if builtin_tools is defined and tool_call.name in builtin_tools %}
            {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' -}}
            {{- "<|python_tag|>" + tool_call.name + ".call(" }}
            {%- for arg_name, arg_val in tool_call.arguments | items %}
                {{- arg_name + '="' + arg_val + '"' }}
                {%- if not loop.last %}
                    {{- ", " }}
                {%- endif %}
                {%- endfor %}
            {{- ")" }}
        {%- else  %}
            {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' -}}
            {{- '{"name": "' + tool_call.name + '", ' }}
            {{- '"parameters": ' }}
            {{- tool_call.arguments | tojson }}
            {{- "}" }}
        {%- endif %}
        {%- if builtin_tools is defined %}
            {#- This means we're in ipython mode #}
            {{- "<|eom_id|>" }}
        {%- else %}
            {{- "<|eot_id|>" }}
        {%- endif %}
    {%- elif message.role == "tool" or message.role == "ipython" %}
        {{- "<|start_header_id|>ipython<|end_header_id|>\n\n" }}
        {%- if message.content is mapping or message.content is iterable %}
            {{- message.content | tojson }}
        {%- else %}
            {{- message.content }}
        {%- endif %}
        {{- "<|eot_id|>" }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}
{%- endif %}
'''

# meta-llama/Llama-2-7b-chat-hf's.
LLAMA2_TEMPLATE = (
    r"{% if messages[0]['role'] == 'system' %}{% set loop_messages = messages[1:] %}"
    r"{% set system_message = messages[0]['content'] %}{% else %}{% set loop_messages = messages %}"
    r"{% set system_message = false %}{% endif %}{% for message in loop_messages %}"
    r"{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    r"{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    r"{% if loop.index0 == 0 and system_message != false %}"
    r"{% set content = '<<SYS>>\n' + system_message + '\n<</SYS>>\n\n' + message['content'] %}"
    r"{% else %}{% set content = message['content'] %}{% endif %}{% if message['role'] == 'user' %}"
    r"{{ bos_token + '[INST] ' + content.strip() + ' [/INST]' }}{% elif message['role'] == 'assistant' %}"
    r"{{ ' '  + content.strip() + ' ' + eos_token }}{% endif %}{% endfor %}"
)

# mistralai/Mixtral-8x7B-Instruct-v0.1's (Mistral-7B-Instruct-v0.1's as released).
MISTRAL_TEMPLATE = (
    r"{{ bos_token }}{% for message in messages %}"
    r"{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    r"{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    r"{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] + ' [/INST]' }}"
    r"{% elif message['role'] == 'assistant' %}{{ message['content'] + eos_token}}"
    r"{% else %}{{ raise_exception('Only user and assistant roles are supported!') }}{% endif %}{% endfor %}"
)

ALPACA_WITH_INPUT = (
    "Below is an instruction that describes a task, paired with an input that provides further context. "
    "Write a response that appropriately completes the request.\n\n"
    "### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:\n"
)
ALPACA_NO_INPUT = (
    "Below is an instruction that describes a task. "
    "Write a response that appropriately completes the request.\n\n"
    "### Instruction:\n{instruction}\n\n### Response:\n"
)


def user(text):
    return {"role": "user", "content": text}


def assistant(text):
    return {"role": "assistant", "content": text}


def system(text):
    return {"role": "system", "content": text}


# Alternating conversations (llama2 and mistral need that; mistral takes no system message).
CONVERSATIONS = [
    [user("Hello world"), assistant("Hi there! How can I help?")],
    [user("what is 12 + 30?"), assistant("42"), user("and 42 * 2?"), assistant("84.")],
    [user("  spaces around  \n"), assistant("\n  answer with spaces\t "), user("ok"), assistant("done")],
    [user("Привет, как дела? 中文测试"), assistant("Хорошо! 你好世界 😀")],
    [user("code:\ndef f(x):\n    return x**2"), assistant("It squares x.\n\n```\nf(3) == 9\n```"),
     user("thanks"), assistant("You're welcome."), user("bye"), assistant("Bye!")],
    [user("empty answer next"), assistant("")],
    [user("a"), assistant("b"), user("c")],
]
SYSTEM_CONVERSATIONS = [
    [system("You are a helpful assistant."), user("Hello"), assistant("Hi!")],
    [system("  Be brief.  "), user("1+1?"), assistant("2"), user("2+2?"), assistant("4")],
]


def read_text(path):
    with open(path, encoding="utf-8") as f:
        return f.read()


def read_indexed(prefix):
    """(dtype code, documents as numpy arrays) of a Megatron .bin/.idx pair, one sequence per document."""
    with open(prefix + ".idx", "rb") as f:
        index = f.read()
    assert index[:9] == b"MMIDIDX\x00\x00"
    code = index[17]
    count, documents = np.frombuffer(index[18:34], dtype=np.uint64)
    lengths = np.frombuffer(index[34:34 + 4 * int(count)], dtype=np.int32)
    pointers = np.frombuffer(index[34 + 4 * int(count):34 + 12 * int(count)], dtype=np.int64)
    doc_index = np.frombuffer(index[34 + 12 * int(count):34 + 12 * int(count) + 8 * int(documents)], dtype=np.int64)
    assert list(doc_index) == list(range(int(count) + 1)), "one sequence per document"
    dtype = {1: np.uint8, 4: np.int32, 8: np.uint16}[code]
    data = np.fromfile(prefix + ".bin", dtype=dtype)
    size = np.dtype(dtype).itemsize
    return code, [data[p // size:p // size + n].astype(np.int64) for p, n in zip(pointers, lengths)]


def hf_ids(tokenizer, messages, **kwargs):
    out = tokenizer.apply_chat_template(messages, tokenize=True, **kwargs)
    return list(out["input_ids"] if hasattr(out, "keys") else out)


def expected_mask(testcase, tokenizer, messages, last_only=False):
    """1 on each assistant turn's tokens, by rendering prefixes with transformers."""
    ids = hf_ids(tokenizer, messages)
    mask = [0] * len(ids)
    turns = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    for i in turns[-1:] if last_only else turns:
        before = hf_ids(tokenizer, messages[:i], add_generation_prompt=True) if i > 0 else []
        through = hf_ids(tokenizer, messages[:i + 1])
        testcase.assertEqual(ids[:len(before)], before, "prefix tokens are a prefix of the whole")
        testcase.assertEqual(ids[:len(through)], through, "prefix tokens are a prefix of the whole")
        for t in range(len(before), len(through)):
            mask[t] = 1
    return ids, mask


class SftPrepVsTransformers(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        from tokenizers import AddedToken, Tokenizer

        cls.directory = forge_test_util.scratch_dir()
        build = os.path.join(cls.directory, "build")
        os.makedirs(build)
        llama3 = Tokenizer.from_file(fixtures.train_byte_level(build))
        llama3.add_special_tokens([AddedToken(t, special=True, normalized=False)
                                   for t in ["<|start_header_id|>", "<|end_header_id|>"]])
        sentencepiece = fixtures.train_sentencepiece_style(build)
        cls.families = {
            "llama3": (llama3.to_str(), LLAMA3_TEMPLATE, "<|begin_of_text|>", "<|eot_id|>"),
            "llama2": (read_text(sentencepiece["llama2-style"]), LLAMA2_TEMPLATE, "<s>", "</s>"),
            "mistral": (read_text(sentencepiece["metaspace-first"]), MISTRAL_TEMPLATE, "<s>", "</s>"),
        }
        cls.tokenizers = {}
        for name, (tokenizer_json, template, bos, eos) in cls.families.items():
            folder = os.path.join(cls.directory, name)
            os.makedirs(folder)
            with open(os.path.join(folder, "tokenizer.json"), "w", encoding="utf-8") as f:
                f.write(tokenizer_json)
            with open(os.path.join(folder, "tokenizer_config.json"), "w", encoding="utf-8") as f:
                json.dump({"bos_token": bos, "eos_token": eos, "chat_template": template}, f)
            cls.tokenizers[name] = folder

    @classmethod
    def tearDownClass(cls):
        shutil.rmtree(cls.directory, ignore_errors=True)

    def hf_tokenizer(self, name):
        from transformers import PreTrainedTokenizerFast

        _, template, bos, eos = self.families[name]
        tokenizer = PreTrainedTokenizerFast(tokenizer_file=os.path.join(self.tokenizers[name], "tokenizer.json"),
                                            bos_token=bos, eos_token=eos)
        tokenizer.chat_template = template
        return tokenizer

    def prep(self, name, lines, *flags, tag="out"):
        inputs = os.path.join(self.directory, f"{name}-{tag}.jsonl")
        with open(inputs, "w", encoding="utf-8") as f:
            for line in lines:
                f.write(json.dumps(line, ensure_ascii=False) + "\n")
        prefix = os.path.join(self.directory, f"{name}-{tag}")
        result = forge_test_util.run([forge_test_util.forge_bin(), "prep", "--format", "sft", "--input", inputs,
                                      "--tokenizer", self.tokenizers[name], "--output-prefix", prefix, *flags])
        code, tokens = read_indexed(prefix)
        mask_code, masks = read_indexed(prefix + ".mask")
        self.assertEqual(mask_code, 1, "mask dataset dtype uint8")
        self.assertEqual([len(t) for t in tokens], [len(m) for m in masks])
        return [list(t) for t in tokens], [list(m) for m in masks], result.stderr + result.stdout

    def conversations(self, name):
        return CONVERSATIONS + (SYSTEM_CONVERSATIONS if name != "mistral" else [])

    def test_chat_templates_equal_transformers(self):
        for name in self.families:
            with self.subTest(template=name):
                tokenizer = self.hf_tokenizer(name)
                conversations = self.conversations(name)
                tokens, masks, log = self.prep(name, [{"messages": c} for c in conversations])
                self.assertIn(f"recognized as {name}", log)
                self.assertEqual(len(tokens), len(conversations))
                for messages, ids, mask in zip(conversations, tokens, masks):
                    want_ids, want_mask = expected_mask(self, tokenizer, messages)
                    self.assertEqual(ids, want_ids, messages)
                    self.assertEqual(mask, want_mask, messages)
                    self.assertEqual(ids[0], tokenizer.bos_token_id)

    def test_train_on_last_turn(self):
        for name in self.families:
            with self.subTest(template=name):
                tokenizer = self.hf_tokenizer(name)
                conversations = self.conversations(name)
                tokens, masks, _ = self.prep(name, [{"messages": c} for c in conversations], "--train-on", "last",
                                             tag="last")
                for messages, ids, mask in zip(conversations, tokens, masks):
                    want_ids, want_mask = expected_mask(self, tokenizer, messages, last_only=True)
                    self.assertEqual((ids, mask), (want_ids, want_mask))

    def test_prompt_completion_and_alpaca_as_one_turn(self):
        lines = [
            {"prompt": "Translate to French: cat", "completion": "chat"},
            {"instruction": "Add the numbers.", "input": "2 and 3", "output": "5"},
            {"instruction": "Name a color.", "output": "Blue", "id": 7},
            {"instruction": "Say hi.", "input": "", "output": "hi"},
        ]
        turns = [
            ("Translate to French: cat", "chat"),
            (ALPACA_WITH_INPUT.format(instruction="Add the numbers.", input="2 and 3"), "5"),
            (ALPACA_NO_INPUT.format(instruction="Name a color."), "Blue"),
            (ALPACA_NO_INPUT.format(instruction="Say hi."), "hi"),
        ]
        for name in self.families:
            with self.subTest(template=name):
                tokenizer = self.hf_tokenizer(name)
                tokens, masks, _ = self.prep(name, lines, "--prepend-bos", tag="pc")
                for (prompt, completion), ids, mask in zip(turns, tokens, masks):
                    want_ids, want_mask = expected_mask(self, tokenizer, [user(prompt), assistant(completion)])
                    self.assertEqual((ids, mask), (want_ids, want_mask))
                    self.assertNotEqual(ids[1], tokenizer.bos_token_id, "--prepend-bos does not double BOS")

    def test_no_template_is_prompt_completion_eos(self):
        from transformers import PreTrainedTokenizerFast

        lines = [{"prompt": "Q: 2+2=", "completion": " 4"},
                 {"instruction": "Repeat: abc", "output": "abc"},
                 {"prompt": "", "completion": "only a completion"}]
        texts = [("Q: 2+2=", " 4"), (ALPACA_NO_INPUT.format(instruction="Repeat: abc"), "abc"),
                 ("", "only a completion")]
        for name in ("llama3", "llama2"):
            with self.subTest(tokenizer=name):
                tokenizer = PreTrainedTokenizerFast(
                    tokenizer_file=os.path.join(self.tokenizers[name], "tokenizer.json"))
                eos = tokenizer.convert_tokens_to_ids(self.families[name][3])  # tokenizer_config.json's eos_token
                bos = tokenizer.convert_tokens_to_ids(self.families[name][2])
                tokens, masks, _ = self.prep(name, lines, "--chat-template", "none", "--prepend-bos", tag="plain")
                for (prompt, completion), ids, mask in zip(texts, tokens, masks):
                    whole = tokenizer(prompt + completion, add_special_tokens=False)["input_ids"]
                    head = tokenizer(prompt, add_special_tokens=False)["input_ids"] if prompt else []
                    self.assertEqual(whole[:len(head)], head)
                    self.assertEqual(ids, [bos] + whole + [eos])
                    self.assertEqual(mask, [0] * (1 + len(head)) + [1] * (len(whole) - len(head) + 1))

    def test_seq_len_truncate_and_drop(self):
        tokenizer = self.hf_tokenizer("llama3")
        long = [user("a short question"), assistant("a long answer " * 40)]
        prompt_only = hf_ids(tokenizer, [user("a short question")], add_generation_prompt=True)
        lines = [{"messages": CONVERSATIONS[0]}, {"messages": long}]
        seq_len = len(hf_ids(tokenizer, CONVERSATIONS[0])) - 1  # the first example fits exactly
        self.assertGreater(seq_len, len(prompt_only) + 2)
        tokens, masks, log = self.prep("llama3", lines, "--seq-len", str(seq_len), tag="trunc")
        want_ids, want_mask = expected_mask(self, tokenizer, long)
        self.assertEqual(tokens[1], want_ids[:seq_len + 1])
        self.assertEqual(masks[1], want_mask[:seq_len + 1])
        self.assertIn("2 examples read, 2 written, 1 truncated, 0 dropped as overlong", log)
        tokens, masks, log = self.prep("llama3", lines, "--seq-len", str(seq_len), "--overlong", "drop", tag="drop")
        self.assertEqual(len(tokens), 1)
        self.assertIn("2 examples read, 1 written, 0 truncated, 1 dropped as overlong", log)
        prompt0 = hf_ids(tokenizer, CONVERSATIONS[0][:1], add_generation_prompt=True)
        short = min(len(prompt_only), len(prompt0)) - 2  # both responses start after the cut
        tokens, masks, log = self.prep("llama3", lines, "--seq-len", str(short), tag="noresp")
        self.assertEqual(len(tokens), 0)
        self.assertIn("2 dropped with no response token left", log)

    def test_bad_line_exits_nonzero_naming_file_line_and_field(self):
        inputs = os.path.join(self.directory, "bad.jsonl")
        with open(inputs, "w", encoding="utf-8") as f:
            f.write(json.dumps({"messages": CONVERSATIONS[0]}) + "\n")
            f.write(json.dumps({"messages": [user("q"), {"role": "tool", "content": "x"}]}) + "\n")
        prefix = os.path.join(self.directory, "bad")
        result = subprocess.run([forge_test_util.forge_bin(), "prep", "--format", "sft", "--input", inputs,
                                 "--tokenizer", self.tokenizers["llama2"], "--output-prefix", prefix],
                                capture_output=True, text=True)
        self.assertNotEqual(result.returncode, 0)
        self.assertIn(f"{inputs}:2:", result.stderr)
        self.assertIn('messages[1].role is "tool"', result.stderr)
        self.assertFalse(any(os.path.exists(prefix + s) for s in (".bin", ".idx", ".mask.bin", ".mask.idx")))

    def test_unrecognized_template_is_refused(self):
        folder = os.path.join(self.directory, "custom")
        shutil.copytree(self.tokenizers["llama3"], folder)
        with open(os.path.join(folder, "tokenizer_config.json"), "w", encoding="utf-8") as f:
            json.dump({"chat_template": LLAMA3_TEMPLATE.replace("Cutting Knowledge", "Knowledge")}, f)
        inputs = os.path.join(self.directory, "custom.jsonl")
        with open(inputs, "w", encoding="utf-8") as f:
            f.write(json.dumps({"messages": CONVERSATIONS[0]}) + "\n")
        result = subprocess.run([forge_test_util.forge_bin(), "prep", "--format", "sft", "--input", inputs,
                                 "--tokenizer", folder, "--output-prefix", os.path.join(self.directory, "custom")],
                                capture_output=True, text=True)
        self.assertNotEqual(result.returncode, 0)
        self.assertIn("tokenizer_config.json", result.stderr)
        self.assertIn("llama3 (Llama 3.1 / 3.3 Instruct), llama2 (Llama 2 Chat) and mistral", result.stderr)
        self.assertFalse(os.path.exists(os.path.join(self.directory, "custom.idx")))
        # Re-indented official source: still recognized.
        with open(os.path.join(folder, "tokenizer_config.json"), "w", encoding="utf-8") as f:
            json.dump({"chat_template": LLAMA2_TEMPLATE.replace("%}{%", "%}\n    {%"), "bos_token": "<s>"}, f)
        shutil.copy(os.path.join(self.tokenizers["llama2"], "tokenizer.json"), os.path.join(folder, "tokenizer.json"))
        result = forge_test_util.run([forge_test_util.forge_bin(), "prep", "--format", "sft", "--input", inputs,
                                      "--tokenizer", folder, "--output-prefix", os.path.join(self.directory, "c2")])
        self.assertIn("recognized as llama2", result.stderr + result.stdout)


if __name__ == "__main__":
    unittest.main()
