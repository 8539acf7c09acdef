"""Where the time of a 16-head MLA decode step goes, replayed (CUDA graphs, medians in µs).

For each row (``--rows``, heads x batch x context) and split count, the step planned once
(:class:`~aiter_attn.kernels.triton.mla.TritonMLA`, static workspace) and then timed as:

* ``step``: the run (attention launch + split merge, or the fused merge);
* ``attention``: the attention launch alone (its partials; no merge);
* ``merge``: the merge launch alone, over the partials the attention wrote;
* ``prologue``: the step with every request one key long (launch, index loads, q, the
  epilogue and the merge: the step's fixed cost);
* ``steady TB/s``: the latent bytes over ``step − prologue``.

``--floor`` adds, on the same timer, what a replayed step costs before any attention work:
an empty Triton launch of one program, two of them back to back (the attention launch and
the merge launch of a split step), and one over the attention's own grid (the row's
``(tokens · head blocks, splits)`` programs, each returning at once).

On the GPU::

    python3 benchmarks/mla_time_split.py --rows 16x64x4096,16x64x1024 --splits 2,4,8 \
        --tunings '[{}, {"one_query": false}]'
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))


def _replay_us(fn, rep: int) -> float:
    import triton.testing as tt

    fn()
    torch.cuda.synchronize()
    return 1000.0 * float(tt.do_bench_cudagraph(fn, rep=rep, return_mode="median"))


def launches(heads, bs, ctx, splits, tuning=None, *, device="cuda", dtype=torch.bfloat16):
    """The row planned once (static workspace): ``(x, out, plan, step, attention, merge)``,
    ``step`` the run, ``attention`` the attention launch alone (into the plan's partials, or
    ``out`` without splits), ``merge`` the merge launch alone (``None`` without a merge
    launch). ``device="cpu"`` runs in Triton's interpreter (the tests)."""
    from _inputs import make_mla

    from aiter_attn.kernels.base import _adhoc_metadata, mla_layer_params
    from aiter_attn.kernels.triton.mla import TritonMLA, mla_request
    from aiter_attn.kernels.triton.mla_merge import merge_splits

    x = make_mla(bs, ctx, heads=heads, dtype=dtype, device=device)
    out = torch.empty(bs, heads, x.rank, dtype=x.q.dtype, device=device)
    kernel = TritonMLA(mla_request(x.q, x.kv_cache, x.rank),
                       dict(tuning or {}, **({"num_kv_splits": splits} if splits else {})))
    md = _adhoc_metadata(x.q, x.kv_cache, x.cu_seqlens_q, x.seqused_k, x.block_table, None,
                         None, 1, ctx, "mla_time_split")
    params = mla_layer_params(scale=x.scale, device=x.q.device, kv_lora_rank=x.rank,
                              num_q_heads=heads, head_dim=x.q.shape[2])
    static: dict = {}
    plan = kernel.plan(md, static)
    kdescs = kernel.tile_descs(x.kv_cache, plan)
    # the run's launch key: (causal, scale from a pointer, LSE out, fp8 value pairs,
    # descriptor tiles)
    key = (params.causal, False, False, False, kdescs is not None)
    kw = plan.kw_cache.get(key) or kernel._kw(plan, key)
    cu = plan.args[0]
    parts = (plan.part_o, plan.part_lse) if plan.use_parts else (out, out)
    ps_o = plan.part_o.stride() if plan.use_parts else (0, 0, 0)
    ps_l = plan.part_lse.stride() if plan.use_parts else (0, 0)

    def step():
        kernel.run(x.q, (x.kv_cache,), plan, params, out)

    def attention():
        kernel._launch_triton(x.q, x.kv_cache, out, plan, params, kw, parts[1], (0, 0), cu,
                              cu, cu, *parts, ps_o, ps_l, kdescs or (x.kv_cache, x.kv_cache))

    merge = None
    if plan.use_parts and not plan.cfg_kw["FUSED_MERGE"]:
        def merge(fixed_order=False):
            merge_splits(out, plan.part_o, plan.part_lse, None, x.rank, kernel.block_dv,
                         fixed_order=fixed_order)
    return x, out, plan, step, attention, merge


def split_row(heads, bs, ctx, splits, rep, tuning=None, timer=_replay_us, merge_fixed=False,
              **where):
    """One row's record: step, attention, merge, prologue (µs, by ``timer(fn, rep)``), TB/s;
    ``merge_fixed``: also the merge launch in its fixed-order form (``merge_fixed``)."""
    x, out, plan, step, attention, merge = launches(heads, bs, ctx, splits, tuning, **where)
    rec = {"row": f"{heads}x{bs}x{ctx}", "tuning": json.dumps(tuning or {}),
           "splits": plan.splits,
           "fused": bool(plan.cfg_kw["FUSED_MERGE"]), "step": timer(step, rep)}
    rec["attention"] = timer(attention, rep) if not rec["fused"] else None
    if merge is not None:
        rec["merge"] = timer(merge, rep)
        if merge_fixed:  # the split-by-split form (one row of R per split, no cross-split tile)
            rec["merge_fixed"] = timer(lambda: merge(True), rep)
    full = x.seqused_k.clone()
    x.seqused_k.fill_(1)
    rec["prologue"] = timer(step, rep)
    x.seqused_k.copy_(full)
    nbytes = x.kv_cache[..., :].element_size() * bs * ctx * (x.rank + x.rope)
    rec["TB/s"] = nbytes / rec["step"] / 1e6
    rec["steady TB/s"] = nbytes / max(rec["step"] - rec["prologue"], 1e-3) / 1e6
    return rec


def _empty_kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def empty(x_ptr, n: tl.constexpr):
        if n < 0:  # never: keeps the argument
            tl.store(x_ptr, 0)

    return empty


def launch_floor(grid: tuple, rep: int, timer=_replay_us, *, device="cuda") -> dict:
    """Empty launches on ``timer`` (µs): ``one`` (one program), ``two`` (two launches of one
    program back to back) and ``grid`` (one launch over ``grid``, every program returning at
    once). The floor under a replayed step's fixed part (``prologue``)."""
    empty = _empty_kernel()
    x = torch.zeros(1, device=device)

    def one():
        empty[(1,)](x, 1)

    def two():
        empty[(1,)](x, 1)
        empty[(1,)](x, 1)

    def full():
        empty[tuple(grid)](x, 1)

    return {"grid": "x".join(map(str, grid)), "one": timer(one, rep), "two": timer(two, rep),
            "grid_us": timer(full, rep)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", default="16x64x4096,16x64x1024")
    p.add_argument("--splits", default="0", help="comma-separated; 0 = the heuristic's")
    p.add_argument("--tunings", default="[{}]",
                   help='JSON list of TritonMLA tuning dicts, each timed on every row, e.g. '
                        '\'[{}, {"fused_merge": true}, {"one_query": false}]\'')
    p.add_argument("--rep", type=int, default=30)
    p.add_argument("--out", default=None)
    p.add_argument("--merge-fixed", action="store_true",
                   help="also time the merge launch in its fixed-order (split by split) form")
    p.add_argument("--floor", action="store_true",
                   help="also time empty launches (one, two, the attention's grid)")
    a = p.parse_args(argv)
    recs = []
    for row in a.rows.split(","):
        heads, bs, ctx = map(int, row.split("x"))
        for sp in map(int, a.splits.split(",")):
            for tuning in json.loads(a.tunings):
                r = split_row(heads, bs, ctx, sp, a.rep, tuning, merge_fixed=a.merge_fixed)
                recs.append(r)
                print(" ".join(f"{k}={v:.2f}" if isinstance(v, float) else f"{k}={v}"
                               for k, v in r.items()), flush=True)
                if a.floor and tuning == json.loads(a.tunings)[0]:
                    grid = launches(heads, bs, ctx, sp, tuning)[2].grid
                    f = launch_floor(grid, a.rep)
                    recs.append(f)
                    print("floor " + " ".join(f"{k}={v:.2f}" if isinstance(v, float)
                                              else f"{k}={v}" for k, v in f.items()),
                          flush=True)
    if a.out:
        os.makedirs(a.out, exist_ok=True)
        with open(os.path.join(a.out, "mla_time_split.json"), "w") as f:
            json.dump(recs, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
