"""Where the engine's persistent decode launch and its per-op path part (issue 35; lab, not installed).

    python dev/mk_diag.py            # four engines against a float32 CPU engine, several shapes
    python dev/mk_diag.py --pairs    # the engine test's own sequence: the launch's caches against the per-op's
    python dev/mk_diag.py --steps    # step by step: cache slots still unwritten after each decode step

Default: for small random models of several shapes (float16 weights) the same prompt and the GPU per-op
engine's greedy tokens (teacher forcing, as tests/test_engine.py's check_megakernel_logits) go through a
float32 CPU engine (the reference), the GPU per-op engine with its CUDA graph and compiled glue, the same
eager, and the GPU engine with the launch; for each GPU engine, the relative logit error against the CPU
and which layers, positions and dims of its K and V caches differ by more than 0.05.

It found (2026-12-05, H100) that the "mismatch" of a 5-head, hidden-320 model was the test's: that model's
greedy run stopped at the config's EOS after 7 tokens, and the test compared cache slots past the last
forced step, which the per-op engine had written in its greedy run and the launch never saw
(dev/PERSISTENT.md).
"""

import copy
import sys

import torch

sys.path.insert(0, "tests")
from qgemv.engine import Engine  # noqa: E402
from test_engine import forced_logits, megakernel_model  # noqa: E402

CASES = ((5, 1, 320, 832), (5, 1, 320, 512), (4, 1, 256, 832), (5, 5, 320, 512), (6, 1, 384, 512),
         (6, 2, 384, 512), (4, 1, 256, 512))


def where_off(a, b, tol):
    """Where caches a and b ([layers, 1, kv heads, slots, D], the slots compared) differ by more than tol:
    "equal", or the count, layers, heads, slots and dims, and how many of those values are zero on each side
    (a zero row: a slot never written)."""
    a, b = a.float().cpu(), b.float().cpu()
    d = (a - b).abs()
    bad = (d > tol).nonzero()
    if not len(bad):
        return f"equal within {tol} (max {d.max().item():.3g})"
    pos = sorted(set(bad[:, 3].tolist()))
    at = tuple(bad.t())
    return (f"{len(bad)} off (max {d.max().item():.3g}): layers {sorted(set(bad[:, 0].tolist()))}, heads "
            f"{sorted(set(bad[:, 2].tolist()))}, slots {pos[:12]}{'...' if len(pos) > 12 else ''}, dims "
            f"{sorted(set(bad[:, 4].tolist()))[:12]}; zero there: {int((a[at] == 0).sum())} / {int((b[at] == 0).sum())}")


def report(name, eng, logits, ref, ref_kv, plen):
    err = ((logits - ref).abs().max() / ref.abs().max()).item()
    used = slice(0, plen + logits.shape[1] - 1)  # the slots the forced steps wrote
    print(f"  {name}: logit error {err:.2e}", flush=True)
    for what, a, b in zip("KV", eng._kv(1), ref_kv):
        print(f"    {what}: {where_off(a[..., used, :], b[..., used, :], 0.05)}", flush=True)


def main() -> None:
    plen, n = 9, 24
    for heads, kv, hid, inter in CASES:
        model = megakernel_model("llama", heads, kv, None, hidden_size=hid, intermediate_size=inter).half().cuda()
        prompt = [torch.randint(0, 512, (plen,), generator=torch.Generator().manual_seed(plen)).tolist()]
        per_op = Engine(model, max_seq_len=128)
        want = per_op.generate(prompt, max_new_tokens=n).tokens
        cpu = Engine(copy.deepcopy(model).float().cpu(), max_seq_len=128)
        ref = forced_logits(cpu, prompt, want)
        ref_kv = cpu._kv(1)
        print(f"heads {heads}/{kv} hidden {hid} intermediate {inter} (head_dim {hid // heads})", flush=True)
        per_op = Engine(model, max_seq_len=128)
        report("per-op, graph + compiled", per_op, forced_logits(per_op, prompt, want), ref, ref_kv, plen)
        eager = Engine(model, max_seq_len=128, cuda_graphs=False, compile_glue=False)
        report("per-op, eager", eager, forced_logits(eager, prompt, want), ref, ref_kv, plen)
        mk = Engine(model, max_seq_len=128, megakernel=True)
        logits = forced_logits(mk, prompt, want)
        report(f"launch (on: {mk.megakernel}, {mk.megakernel_reason or 'ok'})", mk, logits, ref, ref_kv, plen)


def pairs_main() -> None:
    """The engine test's own sequence (check_megakernel_logits: prompt 9, then 100, engines kept alive), then
    prompt 100 alone on a fresh model, twice each: where the launch's caches differ from the per-op engine's."""
    from test_engine import megakernel_pair

    for shape in ((5, 1, 320, 832), (4, 1, 256, 832)):
        for order in (((9, 24), (100, 28)), ((100, 28),), ((9, 24), (100, 28)), ((100, 28),)):
            model = megakernel_model("llama", shape[0], shape[1], None, hidden_size=shape[2],
                                     intermediate_size=shape[3]).half().cuda()
            keep = []
            for plen, n in order:
                per_op, mk, ref, got = megakernel_pair(model, plen, n)
                keep.append((per_op, mk))
                err = ((got - ref).abs().max() / ref.abs().max()).item()
                used = slice(0, plen + n - 1)  # the test's slice before its fix: what the greedy run may leave
                line = f"{shape} order {[p for p, _ in order]} prompt {plen}: logit error {err:.2e}"
                for what, a, b in zip("KV", mk._kv(1), per_op._kv(1)):
                    line += f"; {what} {where_off(a[..., used, :], b[..., used, :], 0.026)}"
                print(line, flush=True)


def steps_main() -> None:
    """Step by step (prompt 9, 24 tokens, GQA 5 at hidden 320): after each decode step of the launch's engine,
    which cache slots up to the step's are still all zero (never written), with and without the CUDA graph."""
    for graphs in (True, False):
        model = megakernel_model("llama", 5, 1, None, hidden_size=320, intermediate_size=832).half().cuda()
        prompt = [torch.randint(0, 512, (9,), generator=torch.Generator().manual_seed(9)).tolist()]
        want = Engine(model, max_seq_len=128).generate(prompt, max_new_tokens=24).tokens
        mk = Engine(model, max_seq_len=128, megakernel=True, cuda_graphs=graphs)
        _, pad = mk.prefill(prompt)
        slot = torch.empty(1, dtype=torch.long, device="cuda")
        tokens = torch.tensor(want, device="cuda")
        for j in range(tokens.shape[1] - 1):
            slot.fill_(9 + j)
            mk._decode(tokens[:, j:j + 1], slot, pad)
            torch.cuda.synchronize()
            k, v = mk._kv(1)
            zk = [p for p in range(10 + j) if k[:, 0, :, p].abs().sum().item() == 0]
            zv = [p for p in range(10 + j) if v[:, 0, :, p].abs().sum().item() == 0]
            print(f"graphs {graphs} slot {9 + j}: position {mk._chain.position.item()}, zero K slots {zk}, "
                  f"zero V slots {zv}", flush=True)


if __name__ == "__main__":
    (pairs_main if "--pairs" in sys.argv else steps_main if "--steps" in sys.argv else main)()
