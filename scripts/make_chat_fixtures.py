#!/usr/bin/env python3
"""Write the chat-template and greedy-generation reference fixtures, with transformers.

It runs the reference implementation (transformers' `apply_chat_template` and `generate`) in a
separate virtual environment, never zerojax's:

    python3 -m venv /work/hfvenv
    /work/hfvenv/bin/pip install torch transformers jinja2 safetensors numpy
    /work/hfvenv/bin/python scripts/make_chat_fixtures.py

Outputs (committed, small) in tests/fixtures/chat/:

    llama3/, chatml/, gemma/    a small byte-level BPE tokenizer each (tokenizer.json,
                                tokenizer_config.json, saved by PreTrainedTokenizerFast), with
                                a real-world chat template: Llama-3-Instruct's header template
                                (kept in tokenizer_config.json, the older place), Qwen2's
                                ChatML template with `{% generation %}` blocks (chat_template.jinja),
                                Gemma's (no system role; chat_template.jinja)
    chats.json                  for each tokenizer and fixed conversation: transformers'
                                apply_chat_template ids (with and without the generation prompt),
                                its assistant mask (return_assistant_tokens_mask) from the template,
                                or, for a template without `{% generation %}`, from a copy of it
                                with the assistant's turns (content through the end of the turn)
                                wrapped in `{% generation %}` ("marked"); and the error
                                transformers raises for a conversation the template refuses
    greedy.json                 greedy continuations (`generate(do_sample=False)`, no EOS stop)
                                of tests/fixtures/hf/llama-gqa for fixed prompts; and the greedy
                                reply (stopping at <|eot_id|>) of llama3/'s model to a user turn
                                through its chat template
    llama3/ also holds a tiny random LlamaForCausalLM of the tokenizer's vocabulary (hidden 32,
                                2 layers, weights as make_hf_fixtures.py draws them): a whole
                                Hugging Face chat model directory, for the SFT recipe and
                                `zerojax generate --chat`
    sft.jsonl                   64 small conversations ({"messages": ...}) for the SFT recipe
    saved/                      its first 8 rows as a Hugging Face `datasets` directory
                                (Dataset.save_to_disk: state.json and an Arrow stream file);
                                needs `pip install datasets` in the same venv

Seeded; re-running with the same versions writes the same bytes.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import torch
import transformers
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import (AutoModelForCausalLM, AutoTokenizer, GenerationConfig, LlamaConfig, LlamaForCausalLM,
                          PreTrainedTokenizerFast)

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "tests" / "fixtures" / "chat"
sys.path.insert(0, str(ROOT / "scripts"))  # make_hf_fixtures: the fixtures' weight draw

# Llama-3-8B-Instruct's template, as published.
LLAMA3 = ("{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = "
          "'<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + "
          "'<|eot_id|>' %}{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}"
          "{{ content }}{% endfor %}{% if add_generation_prompt %}"
          "{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}")
LLAMA3_MARKED = ("{% for message in messages %}{% set head = '<|start_header_id|>' + message['role'] + "
                 "'<|end_header_id|>\n\n' %}{% if loop.index0 == 0 %}{% set head = bos_token + head %}{% endif %}"
                 "{% if message['role'] == 'assistant' %}{{ head }}{% generation %}"
                 "{{ message['content'] | trim + '<|eot_id|>' }}{% endgeneration %}"
                 "{% else %}{{ head + message['content'] | trim + '<|eot_id|>' }}{% endif %}{% endfor %}"
                 "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}")
# Qwen2-Instruct's ChatML template, the assistant's turns in {% generation %} (as SmolLM3's and
# transformers' documentation mark them: the content and <|im_end|>, not the newline after it).
# Written over several indented lines as chat_template.jinja files on the Hub are (SmolLM3's,
# Qwen3's): what it renders depends on trim_blocks and lstrip_blocks.
CHATML = """{%- for message in messages %}
    {%- if loop.first and messages[0]['role'] != 'system' %}
        {{- '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' }}
    {%- endif %}
    {% if message['role'] == 'assistant' %}
        {{- '<|im_start|>assistant\n' }}
        {%- generation %}
        {{- message['content'] + '<|im_end|>' }}
        {%- endgeneration %}
        {{- '\n' }}
    {%- else %}
        {{- '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}
    {%- endif %}
{% endfor %}
{% if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
{%- endif %}
"""
# Gemma-1.1-it's template, as published: no system role, roles must alternate.
GEMMA = ("{{ bos_token }}{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}"
         "{% endif %}{% for message in messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
         "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
         "{% if (message['role'] == 'assistant') %}{% set role = 'model' %}{% else %}{% set role = message['role'] %}"
         "{% endif %}{{ '<start_of_turn>' + role + '\n' + message['content'] | trim + '<end_of_turn>\n' }}"
         "{% endfor %}{% if add_generation_prompt %}{{'<start_of_turn>model\n'}}{% endif %}")
GEMMA_MARKED = ("{{ bos_token }}{% for message in messages %}{% if (message['role'] == 'assistant') %}"
                "{{ '<start_of_turn>model\n' }}{% generation %}{{ message['content'] | trim + '<end_of_turn>\n' }}"
                "{% endgeneration %}{% else %}{{ '<start_of_turn>' + message['role'] + '\n' + "
                "message['content'] | trim + '<end_of_turn>\n' }}{% endif %}{% endfor %}"
                "{% if add_generation_prompt %}{{'<start_of_turn>model\n'}}{% endif %}")

TOKENIZERS = {
    # name: (specials, bos, eos, template, marked copy or None, where the template is kept)
    "llama3": (["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"],
               "<|begin_of_text|>", "<|eot_id|>", LLAMA3, LLAMA3_MARKED, "tokenizer_config.json"),
    "chatml": (["<|endoftext|>", "<|im_start|>", "<|im_end|>"], None, "<|im_end|>", CHATML, None,
               "chat_template.jinja"),
    "gemma": (["<pad>", "<eos>", "<bos>", "<start_of_turn>", "<end_of_turn>"], "<bos>", "<eos>", GEMMA, GEMMA_MARKED,
              "chat_template.jinja"),
}

CHATS = [
    [{"role": "user", "content": "What is ZeRO stage 3?"},
     {"role": "assistant", "content": "It shards the parameters, gradients and optimizer states."}],
    [{"role": "system", "content": "You answer in one line."},
     {"role": "user", "content": "  Name a prime.  "},
     {"role": "assistant", "content": "Seven."},
     {"role": "user", "content": "Another, café-style?"},
     {"role": "assistant", "content": " Eleven, naïvely. \n"}],
    [{"role": "user", "content": "Say <|im_end|> twice"},
     {"role": "assistant", "content": "ok ok"},
     {"role": "user", "content": "thanks"}],
]
BAD = [{"role": "system", "content": "x"}, {"role": "user", "content": "hi"}]

TEXT = ("A user asks and the assistant answers. What is ZeRO stage 3? It shards the parameters, gradients and "
        "optimizer states across the data-parallel devices. Name a prime. Seven. Eleven. café naïve "
        "system user assistant model You answer in one line. You are a helpful assistant. Say twice ok thanks ")


def tokenizer(name: str) -> PreTrainedTokenizerFast:
    specials, bos, eos, template, _, _ = TOKENIZERS[name]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  special_tokens=[AddedToken(s, special=True, normalized=False) for s in specials],
                                  show_progress=False)
    tok.train_from_iterator([TEXT] * 4, trainer)
    if bos:  # as Llama's and Gemma's tokenizers: BOS before a text encoded with special tokens
        tok.post_processor = processors.TemplateProcessing(single=f"{bos} $A", special_tokens=[(bos, tok.token_to_id(bos))])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=bos, eos_token=eos, chat_template=template)


def save(name: str) -> PreTrainedTokenizerFast:
    folder = OUT / name
    shutil.rmtree(folder, ignore_errors=True)
    tokenizer(name).save_pretrained(folder)
    if TOKENIZERS[name][5] == "tokenizer_config.json":  # the older layout: the template inside the config
        jinja = folder / "chat_template.jinja"
        config = json.loads((folder / "tokenizer_config.json").read_text())
        config["chat_template"] = jinja.read_text()
        (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")
        jinja.unlink()
    loaded = AutoTokenizer.from_pretrained(folder)  # as a user's transformers would read it
    assert loaded.chat_template == TOKENIZERS[name][3], name
    return loaded


def reference(name: str, tok) -> dict:
    marked = TOKENIZERS[name][4]
    out = {"chats": []}
    for chat in CHATS:
        if name == "gemma" and chat[0]["role"] == "system":
            continue
        masked = tok.apply_chat_template(chat, chat_template=marked, return_dict=True,
                                         return_assistant_tokens_mask=True)
        out["chats"].append({
            "messages": chat,
            "ids": tok.apply_chat_template(chat, return_dict=True)["input_ids"],
            "ids_generation_prompt": tok.apply_chat_template(chat, add_generation_prompt=True,
                                                             return_dict=True)["input_ids"],
            "text": tok.apply_chat_template(chat, tokenize=False),
            "assistant_mask": masked["assistant_masks"],
            "mask_from": "template" if marked is None else "marked copy",
        })
        assert masked["input_ids"] == out["chats"][-1]["ids"], (name, "the marked copy renders differently")
    try:
        tok.apply_chat_template(BAD)
    except Exception as err:  # noqa: BLE001 - transformers' TemplateError
        out["refused"] = {"messages": BAD, "error": str(err)}
    return out


def chat_model(tok) -> None:
    """A tiny random Llama beside llama3's tokenizer, as a chat model's HF directory holds both."""
    from make_hf_fixtures import TINY_WEIGHT_STD, perturb_

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                         rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False, attn_implementation="eager",
                         bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    model = LlamaForCausalLM(config)
    perturb_(model, TINY_WEIGHT_STD)
    model.save_pretrained(OUT / "llama3")


def chat_reply(tok) -> dict:
    """transformers' greedy reply of llama3/'s model to one user turn, through the chat template."""
    model = AutoModelForCausalLM.from_pretrained(OUT / "llama3", dtype=torch.float32, attn_implementation="eager")
    messages = [{"role": "user", "content": "Name a prime."}]
    prompt = tok.apply_chat_template(messages, add_generation_prompt=True, return_dict=True)["input_ids"]
    config = GenerationConfig(do_sample=False, max_new_tokens=12, eos_token_id=tok.eos_token_id, pad_token_id=0)
    with torch.no_grad():
        # the attention mask given: without it generate masks every pad_token_id, and BOS is id 0 here
        tokens = torch.tensor([prompt])
        ids = model.eval().generate(tokens, attention_mask=torch.ones_like(tokens), generation_config=config)[0].tolist()
    new = ids[len(prompt):]
    reply = tok.decode(new[:-1] if new and new[-1] == tok.eos_token_id else new, skip_special_tokens=True)
    return {"model": "tests/fixtures/chat/llama3", "messages": messages, "max_new_tokens": 12, "prompt": prompt,
            "new": new, "reply": reply}


def sft_rows(n: int = 64) -> list[dict]:
    words = TEXT.lower().replace(".", "").replace("?", "").split()
    g = torch.Generator().manual_seed(3)
    say = lambda k: " ".join(words[i] for i in torch.randint(0, len(words), (k,), generator=g).tolist())  # noqa: E731
    return [{"messages": [{"role": "user", "content": say(4)}, {"role": "assistant", "content": say(6)}]}
            for _ in range(n)]


def greedy() -> dict:
    folder = ROOT / "tests" / "fixtures" / "hf" / "llama-gqa"
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager").eval()
    prompts = [[5, 17, 42], [1, 200, 3, 99, 7, 64, 128, 31]]
    config = GenerationConfig(do_sample=False, max_new_tokens=20, eos_token_id=None, pad_token_id=0)
    runs = []
    with torch.no_grad():
        for prompt in prompts:
            tokens = torch.tensor([prompt])
            ids = model.generate(tokens, attention_mask=torch.ones_like(tokens), generation_config=config)[0].tolist()
            runs.append({"prompt": prompt, "new": ids[len(prompt):]})
    return {"model": "tests/fixtures/hf/llama-gqa", "max_new_tokens": 20, "runs": runs}


def main() -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    tokenizers = {name: save(name) for name in TOKENIZERS}
    chats = {name: reference(name, tok) for name, tok in tokenizers.items()}
    chats["versions"] = {"transformers": transformers.__version__, "torch": torch.__version__.split("+")[0]}
    (OUT / "chats.json").write_text(json.dumps(chats, indent=1, ensure_ascii=False) + "\n")
    chat_model(tokenizers["llama3"])
    (OUT / "greedy.json").write_text(json.dumps({**greedy(), "chat": chat_reply(tokenizers["llama3"])}, indent=1) + "\n")
    (OUT / "sft.jsonl").write_text("".join(json.dumps(r) + "\n" for r in sft_rows()))
    import datasets

    shutil.rmtree(OUT / "saved", ignore_errors=True)
    datasets.Dataset.from_list(sft_rows()[:8]).save_to_disk(str(OUT / "saved"))
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
