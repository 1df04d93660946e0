"""A/B on one GPU and one model: the engine's persistent launch with the final norm, lm_head and the greedy
argmax inside it (qgemv.persist.Head) against the launch followed by the per-op end (norm, cuBLAS lm_head,
argmax), alternating, two rounds.

    python dev/head_ab.py MODEL VARIANT        # e.g. llama2-7b int4g128a (bench_generate's names)

Per row: ms a step and tok/s (prompt 512, 256 new tokens, greedy); in round 1 the step's kernels by kind
(torch.profiler, eager) as bench_generate reports them; at the end, 32 greedy tokens of both, compared.
Exit 2 for an unknown model or variant.
"""
import sys

import torch

from qgemv.engine import Engine
from qgemv.eval import bench_generate as bg
from qgemv.eval.bench_decode import kernel_breakdown

PROMPT, NEW = 512, 256


def engine(model, head: bool) -> Engine:
    """A launch engine with the head (the default where lm_head allows it) or without it."""
    Engine._launch_head = HEAD if head else (lambda self: None)
    e = Engine(model, max_seq_len=PROMPT + NEW + 8, megakernel=True)
    e.eos_ids = set()
    return e


HEAD = Engine._launch_head


def main(argv) -> int:
    if len(argv) != 2 or argv[0] not in bg.MODELS or argv[1] not in bg.VARIANTS:
        print(__doc__, file=sys.stderr)
        print(f"models: {', '.join(bg.MODELS)}; variants: {', '.join(bg.VARIANTS)}", file=sys.stderr)
        return 2
    name, variant = argv
    model = bg.prepare(bg.build_model(name), variant)
    ids = torch.randint(0, model.config.vocab_size, (1, PROMPT), generator=torch.Generator().manual_seed(1)).tolist()
    tokens = {}
    for rnd in (1, 2):
        for head in (False, True):
            e = engine(model, head)
            e.generate(ids, max_new_tokens=3)  # the glue compiled, the graph captured
            out = e.generate(ids, max_new_tokens=NEW)
            if e._chain is None or (e._chain.head is not None) != head:
                print(f"the launch did not run as asked (head={head}): {e.megakernel_reason}", file=sys.stderr)
                return 1
            line = f"{name} {variant} head={head} round {rnd}: {out.ms_per_step:.4f} ms/step " \
                   f"{out.decode_tokens_per_s:.1f} tok/s"
            if rnd == 1:
                dev = e.device
                tok, slot = torch.tensor([[1]], device=dev), torch.tensor([PROMPT], device=dev)
                pad = torch.zeros(1, dtype=torch.long, device=dev)
                kinds, kernels = kernel_breakdown(lambda: e.forward(tok, slot, pad), per_kernel=True)
                line += "  kernels(us): " + ", ".join(f"{k} {v:.0f}" for k, v in
                                                      sorted(kinds.items(), key=lambda kv: -kv[1]))
                line += f"; {sum(n for n, _ in kernels.values()):.0f} kernels"
            else:
                tokens[head] = e.generate(ids, max_new_tokens=32).tokens[0]
            print(line, flush=True)
            del e
            torch.cuda.empty_cache()
    Engine._launch_head = HEAD
    a, b = tokens[True], tokens[False]
    first = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
    print(f"greedy 32 tokens, head against the per-op end: {sum(x == y for x, y in zip(a, b))} equal "
          f"(first difference at {first})")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
