"""Speculative decoding by prompt lookup on a task that repeats its input, in one process.

    PYTHONPATH=. python3 benchmarks/speculative.py [--bits none 4] [--k 2 4 6] [--concurrency 1 4 16] [--rounds 3]

SmolLM2-135M-Instruct (its real weights: float32, or with ``--bits 4`` its 4-bit weights as shipped) is asked,
through its chat template, to write out given paragraphs with their spelling fixed: greedy, at most
``--new-tokens`` tokens. For each concurrency (that many requests, each its own paragraph, on one engine):
mlx-lm's ``generate_step`` (one request at a time: the one-stream baseline), the engine without speculation,
and the engine with ``speculative="ngram"`` at each K (``speculative_max_batch`` raised so that every step
drafts: where drafting stops paying is what this measures), in alternation after a warm-up, medians of
``--rounds``. Prints generated tokens per second of the whole run (prefill included), the ratios against the
engine without speculation, the drafts' acceptance rate and the tokens a drafting step gave a request; and
checks that every answer is the one the engine gives without speculation. ``--draft-models itself random
layers:N`` adds a draft model (K=4): SmolLM2 itself, a random 2-layer model of its vocabulary, or SmolLM2's own
first N layers with its embedding and output head.

``--model qwen3-0.6b|llama-8b`` (random weights: bf16, ``--bits-random 4`` 4-bit) times instead what verifying drafts
costs and gains where their acceptance is set by construction (for a GPU): random prompts of 32-160 tokens,
``--new-tokens`` tokens each (EOS ignored), and drafts that are the answer the engine gave without speculation
(all accepted), each drafted token replaced by a wrong one with probability ``1 - --acceptance``. It counts the
answers that differ from those first ones: in half precision a product over a step's rows may round otherwise
when the rows are more, so a near-tie can go the other way (as between batches of other sizes).
With ``--draft-models itself layers:N`` it times draft models there instead, at each K: the model itself (every
draft right, at the cost of K passes of the whole model) and its first N layers with its embedding and output
head (a small draft sharing the target's weights: on random weights its drafts miss). ``--quiet-after N`` sets
its acceptance by construction: the output projections of the target's layers N on are scaled by
``--quiet-scale`` (0: the target's tokens are its first N layers', every draft right), at no change of cost.
"""

import argparse
import itertools
import random
import statistics
import sys
import time
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from engine_throughput import QWEN3_0_6B, build_model  # this folder
from engine_throughput import prompts_for as random_prompts
from long_context import LLAMA_8B
from mlx.utils import tree_flatten
from mlx_lm.generate import generate_step
from mlx_lm.models import llama, qwen3

from llm_paged_mlx import Engine, SamplingParams
from llm_paged_mlx.engine import speculative

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # smollm2.py: where the model is kept

PARAGRAPHS = [
    "The comittee met on tuesday to discus the new libary budjet. Members agreed that the reading room needs new "
    "chairs and better lighting, and that the childrens section should stay open later on weekends. The treasurer "
    "warned that the heating bill has grown every winter for three years.",
    "Our garden was full of tomatos this summer, more than we could posibly eat. We gave bags of them to the "
    "neighbours, made sauce that we froze in jars, and still the plants kept growing untill the first frost.",
    "The train to the coast leaves at seven in the morning and arives just before noon. Tickets are cheaper if you "
    "buy them a week in advance, and children under twelve travel for half the price with an adult.",
    "Please remember to bring your own lunch on friday, becuase the kitchen will be closed for repairs. Coffee and "
    "tea will still be availble in the meeting room on the second floor from nine oclock.",
    "The old bridge across the river was built in eighteen ninety and repaired twice since then. Engineers say it "
    "is still safe for people on foot, but cars have been sent the long way round since the spring floods.",
    "She practised the piano every evening after dinner, slowly at first and then faster as the peice became "
    "familar. By the end of the month she could play it from memory without a single mistake.",
    "Volunteers cleaned the beach on saturday morning and collected more then forty bags of rubbish. Most of it was "
    "plastic, but they also found a bicycle wheel, two shoes and a surprisingly heavy anchor.",
    "The museum's new exibition shows maps drawn by sailors over four hundred years. Some are beautifully painted, "
    "others are rough sketches, and a few show islands that turned out never to have existed at all.",
]


def load(bits: str):
    from smollm2 import smollm2_dir

    from llm_paged_mlx.models.loading import load_model

    return load_model(str(smollm2_dir()), dequantize=bits == "none", dtype="float32")


def with_layers(config: dict, layers: int) -> dict:
    """A model's ``config`` (its args) for its first ``layers`` layers."""
    types = config.get("layer_types")  # mlx-lm's llama builds a layer per entry
    return {**config, "num_hidden_layers": layers, **({"layer_types": types[:layers]} if types else {})}


def random_draft(model):
    """A 2-layer model of ``model``'s shape and vocabulary with random weights (float32)."""
    mx.random.seed(0)
    draft = llama.Model(llama.ModelArgs.from_dict(with_layers(vars(model.args), 2)))
    mx.eval(draft.parameters())
    return draft


def prompts_for(tokenizer, count: int) -> list[list[int]]:
    asks = [f"Fix the spelling mistakes in this paragraph and write it out again in full:\n\n{p}" for p in PARAGRAPHS]
    chats = [[{"role": "user", "content": asks[i % len(asks)]}] for i in range(count)]
    return [tokenizer.apply_chat_template(chat, add_generation_prompt=True) for chat in chats]


MODELS = {"qwen3-0.6b": (qwen3, QWEN3_0_6B), "llama-8b": (llama, LLAMA_8B)}


def oracle(prompts, answers, acceptance: float, vocab: int):
    """A stand-in for ``speculative.lookup`` that drafts the known answer, each token wrong with probability
    ``1 - acceptance``."""
    rng = random.Random(0)
    known = {tuple(p[:32]): (len(p), a) for p, a in zip(prompts, answers)}

    def lookup(token_ids, k):
        start, answer = known[tuple(token_ids[:32])]
        done = len(token_ids) - start
        return [t if rng.random() < acceptance else (t + 1) % vocab for t in answer[done : done + k]]

    return lookup


def first_layers(model, module, config, layers: int, bits):
    """The first ``layers`` layers of ``model`` with its embedding, final norm and output head: a model of its
    own that holds the same arrays (no copy)."""
    draft = module.Model(module.ModelArgs(**with_layers(config, layers)))
    if bits:
        nn.quantize(draft, group_size=64, bits=bits)
    kept = lambda name: not name.startswith("model.layers.") or int(name.split(".")[2]) < layers  # noqa: E731
    draft.load_weights([(name, value) for name, value in tree_flatten(model.parameters()) if kept(name)])
    return draft


def quiet_layers(model, first: int, scale: float):
    """Scale what layers ``first`` on add to the residual stream (their output projections) by ``scale``: the
    model costs the same, and at 0 its tokens are those of its first ``first`` layers."""
    for layer in model.layers[first:]:
        for projection in (layer.self_attn.o_proj, layer.mlp.down_proj):
            for name in ("weight", "scales", "biases"):  # a quantized layer's codes stay
                if name in projection and projection[name].dtype != mx.uint32:
                    projection[name] = projection[name] * scale
    mx.eval(model.parameters())


def draft_models(args, module, config, model):
    """Time draft models on a random-weight model (``--model ... --draft-models``)."""
    if args.quiet_after is not None:
        quiet_layers(model, args.quiet_after, args.quiet_scale)
    kv = 8 << 30
    params = SamplingParams(max_tokens=args.new_tokens, ignore_eos=True)
    plain = Engine(model, kv_budget_bytes=kv, max_num_seqs=256, enable_prefix_caching=False)
    drafts = {name: model if name == "itself" else first_layers(model, module, config, int(name[7:]), args.bits_random)
              for name in args.draft_models}  # fmt: skip
    weights = f"{args.bits_random}-bit" if args.bits_random else "bf16"
    quiet = f", layers {args.quiet_after}+ scaled by {args.quiet_scale}" if args.quiet_after is not None else ""
    print(f"\n{args.model} {weights}{quiet}, {args.new_tokens} new tokens, draft models, speculative_max_batch "
          f"{args.max_batch}; tok/s and the ratio to the engine without drafts")
    print("| requests | draft model | K | engine | with the draft | acceptance | tokens per draft step | "
          "answers that differ |")
    print("|---:|---|---:|---:|---:|---:|---:|---:|")
    for concurrency in args.concurrency:
        prompts = random_prompts(concurrency, config["vocab_size"], seed=concurrency)
        answers = [o.token_ids for o in plain.generate(prompts, params)]
        for (name, draft), k in itertools.product(drafts.items(), args.k):
            engine = Engine(model, kv_budget_bytes=kv, max_num_seqs=256, enable_prefix_caching=False,
                            draft_model=draft, num_speculative_tokens=k, speculative_max_batch=args.max_batch)
            rates = {"engine": [], "draft": []}
            differ = 0
            for round_ in range(args.rounds + 1):  # the first is a warm-up
                for system, runs in [("engine", plain), ("draft", engine)]:
                    start = time.perf_counter()
                    outputs = runs.generate(prompts, params)
                    if round_:
                        rates[system].append(sum(len(o.token_ids) for o in outputs) / (time.perf_counter() - start))
                    differ += sum(o.token_ids != a for o, a in zip(outputs, answers))
            after = engine.stats()
            base, rate = statistics.median(rates["engine"]), statistics.median(rates["draft"])
            drafted, accepted = after.get("draft_tokens", 0), after.get("accepted_draft_tokens", 0)
            steps = after.get("drafts", 0)
            row = [str(concurrency), name, str(k), f"{base:.0f}", f"{rate:.0f} ({rate / base:.2f}x)",
                   f"{accepted / drafted:.2f}" if drafted else "", f"{(accepted + steps) / steps:.2f}" if steps else "",
                   f"{differ}/{2 * (args.rounds + 1) * len(prompts)}"]  # fmt: skip
            print("| " + " | ".join(row) + " |")
            del engine


def set_acceptance(args):
    """Time drafts of known acceptance on a random-weight model (``--model``)."""
    module, config = MODELS[args.model]
    model = build_model(module, config, mx.bfloat16, args.bits_random)
    if args.draft_models:
        draft_models(args, module, config, model)
        return
    kv = 8 << 30
    params = SamplingParams(max_tokens=args.new_tokens, ignore_eos=True)
    plain = Engine(model, kv_budget_bytes=kv, max_num_seqs=256, enable_prefix_caching=False)
    engines = {f"K={k}": Engine(model, kv_budget_bytes=kv, max_num_seqs=256, enable_prefix_caching=False,
                                speculative="ngram", num_speculative_tokens=k, speculative_max_batch=args.max_batch)
               for k in args.k}  # fmt: skip
    weights = f"{args.bits_random}-bit" if args.bits_random else "bf16"
    print(f"\n{args.model} {weights}, {args.new_tokens} new tokens, speculative_max_batch {args.max_batch}; tok/s "
          "and the ratio to the engine without drafts")
    print("| requests | acceptance | engine | " + " | ".join(engines) + " | answers that differ |")
    print("|---:|---:|---:|" + "---:|" * (len(engines) + 1))
    for concurrency in args.concurrency:
        prompts = random_prompts(concurrency, config["vocab_size"], seed=concurrency)
        answers = [o.token_ids for o in plain.generate(prompts, params)]
        if args.alone and concurrency > 1:  # how far the answers depend on the batch without any draft
            alone = [plain.generate([p], params)[0].token_ids for p in prompts]
            print(f"without drafts, {concurrency} prompts alone against batched: "
                  f"{sum(a != b for a, b in zip(alone, answers))} answers differ")
        for acceptance in args.acceptance:
            speculative.lookup = oracle(prompts, answers, acceptance, config["vocab_size"])
            rates = {name: [] for name in ["engine", *engines]}
            differ = 0  # answers unlike the first ones: half precision rounds a product of more rows otherwise
            for round_ in range(args.rounds + 1):  # the first is a warm-up
                for name, engine in [("engine", plain), *engines.items()]:
                    start = time.perf_counter()
                    outputs = engine.generate(prompts, params)
                    if round_:
                        rates[name].append(sum(len(o.token_ids) for o in outputs) / (time.perf_counter() - start))
                    differ += sum(o.token_ids != a for o, a in zip(outputs, answers))
            base = statistics.median(rates["engine"])
            cells = [f"{statistics.median(rates[n]):.0f} ({statistics.median(rates[n]) / base:.2f}x)" for n in engines]
            answered = (args.rounds + 1) * len(prompts) * (len(engines) + 1)
            row = [str(concurrency), f"{acceptance:.2f}", f"{base:.0f}", *cells, f"{differ}/{answered}"]
            print("| " + " | ".join(row) + " |")


def mlx_lm_run(model, prompts, new_tokens: int, eos: set) -> int:
    """Answer each prompt in turn with mlx-lm's greedy loop; the tokens generated."""
    count = 0
    for prompt in prompts:
        greedy = lambda x: mx.argmax(x, -1)  # noqa: E731
        for token, _ in generate_step(mx.array(prompt), model, max_tokens=new_tokens, sampler=greedy):
            if int(token) in eos:
                break
            count += 1
    return count


def draft_model_name(name: str) -> str:
    if name in ("itself", "random") or (name.startswith("layers:") and name[7:].isdigit() and int(name[7:]) > 0):
        return name
    raise argparse.ArgumentTypeError(f"{name!r}: itself, random or layers:N")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--bits", nargs="+", default=["none"], choices=["none", "4"])
    parser.add_argument("--k", type=int, nargs="+", default=[2, 4, 6], help="num_speculative_tokens to time")
    parser.add_argument("--draft-models", nargs="*", default=[], type=draft_model_name,
                        help="also draft with a model: SmolLM2 itself (every draft right, at its own cost), or a "
                             "2-layer random one of its vocabulary (its drafts wrong: what misses cost); with "
                             "--model: itself, or layers:N (its first N layers)")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--new-tokens", type=int, default=160)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--model", choices=MODELS, help="a random-weight model, drafts of set acceptance (GPU)")
    parser.add_argument("--bits-random", type=int, choices=[4], help="with --model: 4-bit weights (group 64)")
    parser.add_argument("--acceptance", type=float, nargs="+", default=[1.0, 0.7])
    parser.add_argument("--max-batch", type=int, default=1024, help="with --model: speculative_max_batch")
    parser.add_argument("--quiet-after", type=int, metavar="N",
                        help="with --model and --draft-models: scale the output projections of layers N on by "
                             "--quiet-scale, so that a draft of its first N layers agrees with the model")
    parser.add_argument("--quiet-scale", type=float, default=0.0,
                        help="with --quiet-after: the scale (0: the draft's greedy tokens are the model's)")
    parser.add_argument("--alone", action="store_true", help="with --model: each prompt also alone, no drafts")
    args = parser.parse_args()
    print(f"mlx {mx.__version__}, device {mx.default_device()}")
    if args.model:
        set_acceptance(args)
        return
    for bits in args.bits:
        model, tokenizer = load(bits)
        eos = set(tokenizer.eos_token_ids)
        engines = {"engine": Engine(model, tokenizer, num_blocks=4096)}
        for k in args.k:
            engines[f"ngram K={k}"] = Engine(model, tokenizer, num_blocks=4096, speculative="ngram",
                                             num_speculative_tokens=k, speculative_max_batch=1024)  # fmt: skip
        for name in args.draft_models:
            if name == "itself":
                draft = load(bits)[0]
            elif name == "random":
                draft = random_draft(model)
            else:
                draft = first_layers(model, llama, vars(model.args), int(name[7:]), None if bits == "none" else 4)
            engines[f"draft model ({name}) K=4"] = Engine(model, tokenizer, num_blocks=4096, draft_model=draft,
                                                          speculative_max_batch=1024)  # fmt: skip
        print(f"\nSmolLM2-135M {'float32' if bits == 'none' else '4-bit'}, at most {args.new_tokens} new tokens")
        print("| requests | system | tok/s | / engine | acceptance | tokens per draft step |")
        print("|---:|---|---:|---:|---:|---:|")
        for concurrency in args.concurrency:
            prompts = prompts_for(tokenizer, concurrency)
            params = SamplingParams(max_tokens=args.new_tokens)
            rates = {name: [] for name in ["mlx-lm generate_step", *engines]}
            answers, stats = {}, {}
            for round_ in range(args.rounds + 1):  # the first is a warm-up
                start = time.perf_counter()
                count = mlx_lm_run(model, prompts, args.new_tokens, eos)
                if round_:
                    rates["mlx-lm generate_step"].append(count / (time.perf_counter() - start))
                for name, engine in engines.items():
                    before = engine.stats()
                    start = time.perf_counter()
                    outputs = engine.generate(prompts, params)
                    elapsed = time.perf_counter() - start
                    answers[name] = [o.token_ids for o in outputs]
                    if round_:
                        rates[name].append(sum(len(t) for t in answers[name]) / elapsed)
                        after = engine.stats()
                        drafted = after.get("draft_tokens", 0) - before.get("draft_tokens", 0)
                        accepted = after.get("accepted_draft_tokens", 0) - before.get("accepted_draft_tokens", 0)
                        drafts = after.get("drafts", 0) - before.get("drafts", 0)
                        if drafts:
                            stats[name] = (accepted / drafted, (accepted + drafts) / drafts)
                mismatched = [name for name in engines if answers[name] != answers["engine"]]
                if mismatched:
                    raise SystemExit(f"answers differ from the engine's without speculation: {mismatched}")
            base = statistics.median(rates["engine"])
            for name, values in rates.items():
                rate = statistics.median(values)
                acceptance, per_step = stats.get(name, (None, None))
                cells = [f"{acceptance:.2f}" if acceptance is not None else "", f"{per_step:.2f}" if per_step else ""]
                print(f"| {concurrency} | {name} | {rate:.1f} | {rate / base:.2f}x | {cells[0]} | {cells[1]} |")


if __name__ == "__main__":
    main()
