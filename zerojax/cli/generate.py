"""`zerojax generate`: text from a run's checkpoint or a Hugging Face directory with a KV cache
(a prompt, or a conversation on stdin), or a vision-language run's held-out answers."""

from __future__ import annotations

import json
import math
import sys

from zerojax.cli.args import Parser, UsageError, positive_int

HELP = "text from a run's checkpoint or a Hugging Face directory (a prompt, or a conversation on stdin), with a KV cache"


def arguments(generate: Parser) -> None:
    generate.add_argument("source", metavar="RUN_DIR|HF_DIR")
    what = generate.add_mutually_exclusive_group(required=True)
    what.add_argument("--prompt", metavar="TEXT", help="continue TEXT")
    what.add_argument("--chat", action="store_true", help="a conversation through the chat template: each line of "
                      "stdin a user turn, each reply printed, until EOF")
    what.add_argument("--held-out", action="store_true", help="a vision-language run (model.family=paligemma): "
                      "greedy answers to its data's held-out examples and their exact match")
    generate.add_argument("--blank-images", action="store_true", help="--held-out: every image white (the "
                          "text-only baseline)")
    generate.add_argument("--limit", type=positive_int, metavar="N", help="--held-out: the first N examples")
    generate.add_argument("--json", action="store_true", help="--held-out: one JSON document")
    generate.add_argument("--max-new-tokens", type=positive_int, default=128, metavar="N")
    generate.add_argument("--temperature", type=float, default=0.8, metavar="T", help="0: greedy (default 0.8)")
    generate.add_argument("--top-p", type=float, default=1.0, metavar="P", help="nucleus sampling (default 1: off)")
    generate.add_argument("--seed", type=int, default=0, metavar="S")
    generate.add_argument("--step", type=int, help="RUN_DIR: a checkpoint step (default: the newest)")


def run(args) -> int:
    if not (0 <= args.temperature < math.inf):
        raise UsageError(f"--temperature {args.temperature} must be a finite number >= 0 (0: greedy)")
    if not 0 < args.top_p <= 1:
        raise UsageError(f"--top-p {args.top_p} must be in (0, 1]")
    if not args.held_out and (args.blank_images or args.limit or args.json):
        raise UsageError("--blank-images, --limit and --json go with --held-out")
    if args.held_out:
        return _held_out(args)
    from flax import nnx

    from zerojax.train import sample

    if args.chat and (tokenizer := sample.tokenizer_of(args.source)) is not None:
        sample.chat_tokenizer(tokenizer)  # the cheap check first: a template, before the checkpoint is read
    loaded = sample.load_for_generation(args.source, args.step)
    graphdef, params = nnx.split(loaded.model)
    generator = sample.Generator(lambda p: nnx.merge(graphdef, p), params, loaded.seq_len,
                                 callable(getattr(loaded.model, "decode", None)), args.temperature, args.top_p)
    print(f"zerojax: generating from {loaded.where}", file=sys.stderr)
    if args.chat:
        for reply, stats in sample.chat_turns(generator, loaded.tokenizer, sys.stdin, args.max_new_tokens, args.seed):
            print(reply, flush=True)
            _speed(stats)
    else:
        text, stats = sample.continuation(generator, loaded.tokenizer, args.prompt, args.max_new_tokens, args.seed)
        print(text)
        _speed(stats)
    return 0


def _held_out(args) -> int:
    from zerojax.train import answer

    answers = answer.held_out(args.source, args.step, args.blank_images, args.limit or 0, args.max_new_tokens)
    exact = sum(a.exact for a in answers)
    if args.json:
        print(json.dumps({"examples": len(answers), "exact": exact, "exact_match": exact / len(answers),
                          "blank_images": args.blank_images,
                          "answers": [{"prefix": a.prefix, "expected": a.expected, "answer": a.answer}
                                      for a in answers]}))
        return 0
    for a in [a for a in answers if not a.exact][:5]:
        print(f"  {a.prefix!r}: answered {a.answer!r}, expected {a.expected!r}")
    print(f"exact match {exact}/{len(answers)} = {exact / len(answers):.1%} on the held-out examples"
          f"{' with every image blank' if args.blank_images else ''} (greedy)")
    return 0


def _speed(stats) -> None:
    print(f"zerojax: {stats.new_tokens} new tokens after {stats.prompt_tokens}: prefill and first token "
          f"{stats.first_s:.2f} s, then {stats.tokens_per_s:,.1f} tokens/s (after the second token)",
          file=sys.stderr, flush=True)
