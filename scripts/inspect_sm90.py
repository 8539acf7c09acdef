"""Compile our Triton attention kernels for sm_90 on any host (no GPU needed) and report how
Triton pipelined them: shared memory, ``cp.async`` / plain global loads, tensor-core ops and
the ``async_wait`` counts of each loop (``num = 0`` at a loop top means no copy is in flight
while the tile computes). Triton's wheel carries ptxas, so this runs on the CPU-only machine.

Usage::

    python scripts/inspect_sm90.py paged '{"kv": "bf16", "BLOCK_M": 128, "BLOCK_N": 128,
        "warps": 8, "stages": 3, "PAGE_CHUNK": 16}' [--dump DIR]
    python scripts/inspect_sm90.py paged '{"launched": "64x16384", "kv": "fp8e4nv"}'
    python scripts/inspect_sm90.py mla '{"kv": "fp8e4nv", "BLOCK_H": 16, "BLOCK_N": 64,
        "warps": 4, "stages": 3}'

The JSON sets the kernel's constexprs (see the kernels' signatures) and launch options;
``kv``/``q`` are Triton type names (bf16, fp16, fp8e4nv). ``"launched": "BSxCTX"`` (with
``"q_len"``, default 1) starts from the tiles, warps, stages, split and page lookup the
library itself picks for that shape on an H200. ``--dump`` writes TTGIR and PTX. The report
includes the cubin's registers and stack bytes (``cuobjdump -res-usage``): stack > 0 means
ptxas spilled.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys

import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

_TL = {"bf16": tl.bfloat16, "fp16": tl.float16, "fp32": tl.float32}


def _compile(fn, ptr_types, scalars_f32, no_div, const, warps, stages):
    names = fn.arg_names
    sig = {}
    for n in names:
        if n in const:
            sig[n] = "constexpr"
        elif n in ptr_types:
            t = ptr_types[n]
            sig[n] = t[1:-1] if t.startswith("<") else "*" + t
        else:
            sig[n] = "fp32" if n in scalars_f32 else "i32"
    # integer arguments that are multiples of 16 at launch get Triton's divisibility hint
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names)
             if sig[n] != "constexpr" and n not in no_div and n not in scalars_f32}
    src = ASTSource(fn, sig, constexprs={(names.index(k),): v for k, v in const.items()},
                    attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32),
                          options=dict(num_warps=warps, num_stages=stages))


def launched_constexprs(launched: str, q_len: int = 1, fp8: bool = False) -> dict:
    """The tile constexprs and launch options the library picks on an H200 (132 SMs, 227 KB
    of shared memory) for ``launched`` = ``"BSxCTX"`` (GQA 32/8, head dim 128, page 16,
    ``q_len`` queries per request, hinted as in the engine), from the real chooser
    (:func:`aiter_attn.kernels.triton._launch_config.choose_config`'s cached core)."""
    from aiter_attn.kernels.triton import _launch_config as lc

    bs, ctx = (int(x) for x in launched.lower().split("x"))
    cfg = lc._choose_config_cached(4, q_len, ctx, 128, bs, 8, 132, (), False, False, fp8,
                                   232448 - 2048)
    page = 16
    blocks = -(-q_len // cfg.block_q)
    search = bs * blocks > -(-(bs * q_len) // cfg.block_q) + bs
    return dict(HEADS=cfg.heads, NUM_HCHUNKS=-(-4 // cfg.heads), BLOCK_Q=cfg.block_q,
                BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, PAGE_SIZE=page, PAGE_CHUNK=cfg.page_chunk_for(page),
                SPLIT=cfg.num_splits > 1, SEARCH_SEQ=search, WARP_SPEC=cfg.warp_spec,
                PDL=cfg.pdl, V_PAIRS=fp8 and lc.FP8_VALUE_PAIRS and cfg.block_m < 64,
                PREFETCH_PAGES=bool(lc.PREFETCH_PAGES and cfg.num_splits > 1
                                    and cfg.page_chunk_for(page)
                                    and lc._cdiv(lc._cdiv(ctx, cfg.block_n), cfg.num_splits)
                                    <= cfg.page_chunk_for(page) and not search),
                PAGE_AHEAD=bool((lc.CARRIED_PAGE_LOOKUP or cfg.page_ahead)
                                and not cfg.page_chunk_for(page)),
                # the benchmark's caches: contiguous NHD pages (slot addressing allowed)
                FLAT_SLOTS=cfg.flat_slots,
                warps=cfg.num_warps,
                stages=cfg.num_stages,
                num_splits=cfg.num_splits,
                # the per-launch ints as the engine passes them (Triton specialises each:
                # 1 -> a constant, a multiple of 16 -> a divisibility hint)
                ints=dict(num_seqs=bs, q_blocks_per_seq=blocks, num_splits=cfg.num_splits,
                          split_tiles=0, bt_width=-(-ctx // page), left=1 << 30,
                          right=1 << 30))


def _specialise_ints(ints: dict, const: dict, fixed=()) -> set:
    """Triton's launch-time integer specialisation applied to ``ints`` (name -> value):
    values of 1 become constexprs in ``const``; the names returned get no divisibility hint
    (not multiples of 16). ``fixed``: the kernel's ``do_not_specialize`` names (never
    specialised). The launch's register count depends on it (H200, 8x64k decode: 168
    registers with q_blocks_per_seq specialised to 1 as launched, a different allocation
    without)."""
    no_div = set()
    for name, value in ints.items():
        if name in fixed:
            no_div.add(name)
        elif value == 1:
            const.setdefault(name, 1)
        elif value % 16:
            no_div.add(name)
    return no_div


def compile_paged(kv="bf16", q="bf16", warps=None, stages=None, launched=None, q_len=1,
                  **const):
    from aiter_attn.kernels.triton import paged_attention as pa

    fp8 = kv.startswith("fp8")
    no_div = {"left", "right", "num_seqs", "q_blocks_per_seq", "num_splits", "split_tiles",
              "bt_width"}
    int_const = {}
    if launched is not None:  # the library's own choice for this shape, then the JSON's
        chosen = launched_constexprs(launched, q_len, fp8)
        chosen.pop("num_splits")
        no_div = _specialise_ints(chosen.pop("ints"), int_const,
                                  set(pa._paged_attn_kernel.do_not_specialize))
        # the JSON's warps / stages win over the chooser's, like its constexprs
        chosen_warps, chosen_stages = chosen.pop("warps"), chosen.pop("stages")
        warps, stages = warps or chosen_warps, stages or chosen_stages
        const = {**chosen, **const}
    warps, stages = warps or 8, stages or 3
    c = dict(GROUP=4, HEADS=4, NUM_HCHUNKS=1, BLOCK_M=128, BLOCK_N=128, D=128, D_PAD=128,
             DV=128, DV_PAD=128, PAGE_SIZE=16, CAUSAL=True, HAS_SOFTCAP=False, HAS_SINKS=False,
             HAS_SCALES=fp8, HAS_CUSTOM_MASK=False, SEARCH_SEQ=False, SPLIT=False,
             COMPUTE_DTYPE=tl.float16 if fp8 and q == "bf16" else _TL[q],
             CLAMP_Q=fp8 and q == "bf16", DOT_PRECISION="tf32", NUM_STAGES=stages,
             WARP_SPEC=False, PAGE_CHUNK=16, KX=1, VX=1, WRITE_LSE=False, FIXED_SPLITS=False,
             FUSED_REDUCE=False, TOKEN_SCALES=False, V_PAIRS=False, PREFETCH_PAGES=False,
             PAGE_AHEAD=False, FLAT_SLOTS=False)
    # head-dim strides of NHD caches are 1: Triton's launcher specialises integer arguments
    # equal to 1 into constants, so they are constexprs here too
    c.update(stride_kd=1, stride_vd=1)
    c.update(int_const)
    c.update(const)
    c.setdefault("BLOCK_Q", c["BLOCK_M"] // c["HEADS"])
    c["TILE_IN_PAGE"] = c["PAGE_SIZE"] % c["BLOCK_N"] == 0
    ptrs = dict(Q=q, K=kv, V=kv, O=q, PartAcc="fp32", PartML="fp32", CuQ="i32", SeqK="i32",
                BlockTable="i32", Sinks="fp32", KScale="fp32", VScale="fp32", Mask="u8",
                MaskIndptr="i32", Lse="fp32", Counters="i32", KSc="fp32", VSc="fp32")
    return _compile(pa._paged_attn_kernel, ptrs, {"sm_scale", "softcap"}, no_div, c, warps,
                    stages)


def compile_reduce(warps=4, stages=1, **const):
    """The paged kernel's split reduction (``_reduce_splits_kernel``): bf16 output, head
    dim 128, up to 16 splits unless the JSON says otherwise."""
    from aiter_attn.kernels.triton import paged_attention as pa

    c = dict(DV=128, DV_PAD=128, SPLITS_PAD=16, HAS_SINKS=False, WRITE_LSE=False,
             FIXED_ORDER=False, PDL=False)
    c.update(const)
    ptrs = dict(O="bf16", PartAcc="fp32", PartML="fp32", Sinks="fp32", Lse="fp32")
    return _compile(pa._reduce_splits_kernel, ptrs, set(), {"num_splits"}, c, warps, stages)


def compile_mla_merge(warps=4, stages=1, part="fp32", **const):
    """The MLA kernels' split merge (``mla_merge._mla_merge_kernel``): bf16 output, rank
    512, 4 splits unless the JSON says otherwise; ``part``: the partials' dtype (``"bf16"``:
    ``half_partials``)."""
    from aiter_attn.kernels.triton import mla_merge

    c = dict(KV_LORA=512, BLOCK_DV=512, NUM_SPLITS=4, BLOCK_S=4, WRITE_LSE=False,
             FIXED_ORDER=False, PDL=False)
    c.update(const)
    ptrs = dict(out_ptr="bf16", part_o_ptr=part, part_lse_ptr="fp32", lse_ptr="fp32")
    return _compile(mla_merge._mla_merge_kernel, ptrs, set(), set(), c, warps, stages)


def compile_mla(kv="bf16", q="bf16", warps=4, stages=3, part="fp32", **const):
    from aiter_attn.kernels.triton import mla

    fp8 = kv.startswith("fp8")
    c = dict(PAGE_SIZE=64, KV_LORA=512, ROPE=64, BLOCK_DV=512, BLOCK_DR=64, BLOCK_H=16,
             BLOCK_N=64, BLOCK_B=64, NUM_SPLITS=1, CAUSAL=False, HAS_MASK=False,
             SCALE_FROM_PTR=False, IEEE=False, EVEN_D=True, PAGE_CHUNK=0,
             FP16_DOTS=fp8 and q == "bf16", SPLIT_V_LOAD=fp8, WRITE_LSE=False,
             FIXED_CHUNK=0, PDL=False, V_PAIRS=False, FUSED_MERGE=0, ONE_QUERY=False,
             KV_DESC=False, LAZY_RESCALE=False, QK_SPLIT=1)
    c.update(const)
    c["TILE_IN_PAGE"] = c["PAGE_SIZE"] % c["BLOCK_N"] == 0
    bn = c["BLOCK_N"]
    # the cache's tensor descriptors (KV_DESC): "*T" names a pointer, a string in <> a type
    desc = ({"kn_desc": f"<tensordesc<{kv}[{bn}, {c['KV_LORA'] // c['QK_SPLIT']}]>",
             "kr_desc": f"<tensordesc<{kv}[{bn}, {c['ROPE']}]>"} if c["KV_DESC"]
            else {"kn_desc": kv, "kr_desc": kv})
    ptrs = dict(q_ptr=q, kv_ptr=kv, **desc, out_ptr=q, part_o_ptr=part, part_lse_ptr="fp32",
                cu_q_ptr="i32", seqused_ptr="i32", bt_ptr="i32", mask_ptr="u8",
                mask_indptr_ptr="i64", scale_ptr="fp32", lse_ptr="fp32", count_ptr="i32")
    return _compile(mla._mla_fwd_kernel, ptrs, {"qk_scale_log2", "kv_scale_val"},
                    {"num_heads", "batch", "num_head_blocks"}, c, warps, stages)


def compile_mla_balanced(kv="bf16", warps=4, stages=3, part="bf16", **const):
    """The balanced MLA launch (``mla_balanced._mla_balanced_kernel``, q of the cache's
    dtype), 16 heads, latents 512 + 64, 32-key tiles by default."""
    from aiter_attn.kernels.triton import mla_balanced

    c = dict(PAGE_SIZE=64, KV_LORA=512, ROPE=64, BLOCK_DV=512, BLOCK_DR=64, BLOCK_H=16,
             BLOCK_N=32, BLOCK_B=64, SCALE_FROM_PTR=False, IEEE=False, EVEN_D=True,
             WRITE_LSE=False, PDL=False)
    c.update(const)
    c["TILE_IN_PAGE"] = c["PAGE_SIZE"] % c["BLOCK_N"] == 0
    ptrs = dict(q_ptr=kv, kv_ptr=kv, out_ptr=kv, lse_ptr="fp32", part_o_ptr=part,
                part_lse_ptr="fp32", seqused_ptr="i32", bt_ptr="i32", scale_ptr="fp32")
    return _compile(mla_balanced._mla_balanced_kernel, ptrs, {"qk_scale_log2", "kv_scale_val"},
                    {"num_heads", "batch", "num_programs"}, c, warps, stages)


def resource_usage(kernel) -> dict:
    """``{"REG": n, "STACK": bytes, "LOCAL": bytes, ...}`` of the compiled cubin, read with
    the ``cuobjdump -res-usage`` that Triton's wheel carries. ``STACK`` > 0 means ptxas
    spilled registers (spills never show in the PTX: ptxas allocates the registers)."""
    import subprocess
    import tempfile

    import triton.backends.nvidia.compiler as nvidia

    tool = os.path.join(os.path.dirname(nvidia.__file__), "bin", "cuobjdump")
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "k.cubin")
        with open(path, "wb") as f:
            f.write(kernel.asm["cubin"])
        text = subprocess.run([tool, "-res-usage", path], capture_output=True, text=True,
                              check=True).stdout
    return {k: int(v) for k, v in re.findall(r"\b([A-Z]+):(\d+)", text)}


def _gdc_wait_first(ptx: str):
    """With programmatic dependent launch: whether ``griddepcontrol.wait`` comes before the
    kernel's first global read (``ld.global`` / ``cp.async``); ``None`` without it."""
    wait = ptx.find("griddepcontrol.wait")
    if wait < 0:
        return None
    reads = [i for i in (ptx.find("ld.global"), ptx.find("cp.async")) if i >= 0]
    return not reads or wait < min(reads)


def _loads_before(ptx: str, instruction: str) -> int:
    """Global loads issued before the kernel's first ``instruction`` (a regex): ``bra`` (the
    PTX keeps a load after a branch it could skip, so these are the first round trip) or
    ``bar.sync`` (a load after a CTA barrier waits for what comes before it)."""
    body = ptx[ptx.find(".entry"):]
    first = re.search(r"\s" + instruction + r"\s", body)
    return len(re.findall(r"ld\.global", body[:first.start() if first else len(body)]))


def _longest_chain(instructions) -> int:
    """The longest chain of dependent tensor-core mmas in program order, from ``(is_mma,
    written registers, accumulator-input registers)`` per instruction: an mma is one deeper
    than the deepest mma that wrote its accumulator input (C); any other instruction writing
    a register starts it over. Each link waits the mma latency (q·Kᵀ of a 16-head MLA tile:
    one chain as deep as the latent width / 16)."""
    depth: dict = {}
    best = 0
    for is_mma, written, acc in instructions:
        if is_mma:
            d = 1 + max([depth.get(r, 0) for r in acc] + [0])
            best = max(best, d)
            for r in written:
                depth[r] = d
        else:
            for r in written:
                depth.pop(r, None)
    return best


def _mma_chain(ptx: str) -> int:
    """:func:`_longest_chain` of the PTX's ``mma.sync`` (whole kernel, program order)."""
    def parsed():
        for line in ptx.splitlines():
            line = line.strip()
            if not line or line.startswith(("//", ".", "$", "{", "}")) or line.endswith(":"):
                continue
            op, _, rest = line.partition(" ")
            groups = re.findall(r"\{([^}]*)\}|(%[\w.]+)", rest)
            ops = [g[0] or g[1] for g in groups]
            if not ops:
                continue
            mma = op.startswith("mma.sync") and len(ops) >= 4
            yield (mma, re.findall(r"%[\w.]+", ops[0]),
                   re.findall(r"%[\w.]+", ops[3]) if mma else ())
    return _longest_chain(parsed())


def report(kernel) -> dict:
    ptx, ttgir = kernel.asm["ptx"], kernel.asm["ttgir"]
    res = resource_usage(kernel)
    return {
        "gdc wait before first read": _gdc_wait_first(ptx),
        "registers": res["REG"],
        "stack bytes (ptxas spills)": res.get("STACK", 0),
        "shared_bytes": kernel.metadata.shared,
        "cp.async (16 B)": len(re.findall(r"cp\.async\.cg", ptx)),
        "ld.global": len(re.findall(r"ld\.global", ptx)),
        # global stores by width: 16-byte vectors (v4 of 32 bits) and narrower ones
        "st.global 16 B": len(re.findall(r"st\.global(\.[a-z]+)*\.v4\.b32", ptx)),
        "st.global narrower": len(re.findall(r"st\.global(?!(\.[a-z]+)*\.v4\.b32)", ptx)),
        "local-memory ops in the PTX": len(re.findall(r"(ld|st)\.local", ptx)),
        "wgmma": len(re.findall(r"wgmma\.mma_async", ptx)),
        "mma.sync": len(re.findall(r"mma\.sync", ptx)),
        "longest mma.sync chain": _mma_chain(ptx),
        "8-bit shared loads": len(re.findall(r"ld\.shared\.[bus]8", ptx)),
        "ld.global before the first branch": _loads_before(ptx, r"bra(\.uni)?"),
        "ld.global before the first bar.sync": _loads_before(ptx, r"bar\.sync"),
        "ldmatrix": len(re.findall(r"ldmatrix", ptx)),
        "async_wait per loop": re.findall(r"async_wait.*?\{num = (\d+)", ttgir),
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("kernel", choices=("paged", "mla", "mla_balanced", "reduce", "mla_merge"))
    ap.add_argument("config", nargs="?", default="{}", help="JSON constexprs / options")
    ap.add_argument("--dump", help="write k.ttgir, k.ptx, k.cubin and k.sass into this folder "
                    "and print the SASS's innermost tensor-core loops")
    ap.add_argument("--json", action="store_true", help="print the report as one JSON object")
    args = ap.parse_args(argv)
    cfg = json.loads(args.config)
    k = {"paged": compile_paged, "mla": compile_mla, "mla_balanced": compile_mla_balanced,
         "reduce": compile_reduce, "mla_merge": compile_mla_merge}[args.kernel](**cfg)
    rep = report(k)
    if args.json:
        print(json.dumps(rep))
    else:
        for key, val in rep.items():
            print(f"{key:28s} {val}")
    if args.dump:
        os.makedirs(args.dump, exist_ok=True)
        for ext in ("ttgir", "ptx"):
            with open(os.path.join(args.dump, "k." + ext), "w") as f:
                f.write(k.asm[ext])
        write_sass(k, args.dump)
        with open(os.path.join(args.dump, "k.sass")) as f:
            loops = sass_loops(f.read())
        for lp in loops:  # the key loops: instructions per warp and tile
            if args.json:
                print(json.dumps({"sass loop": lp}))
            else:
                top = ", ".join(f"{o} {n}" for o, n in list(lp["opcodes"].items())[:12])
                print(f"SASS loop at {lp['at']}: {lp['instructions']} instructions, "
                      f"{lp['HMMA']} HMMA, longest HMMA chain {lp['longest HMMA chain']} "
                      f"({top})")
    return 0


def sass_loops(sass: str) -> list:
    """The innermost loops (a backward branch whose range holds no other) of a ``cuobjdump
    -sass`` listing that issue tensor-core instructions: ``{"at", "instructions", "HMMA",
    "longest HMMA chain", "opcodes"}`` each (a key loop's instructions per warp and tile;
    the chain: HMMAs whose accumulator input an earlier HMMA of the loop body wrote)."""
    ins = []
    for line in sass.splitlines():
        m = re.match(r"\s*/\*([0-9a-f]{4,})\*/\s+(.*?);", line)
        if m:
            ins.append((int(m.group(1), 16), m.group(2).strip()))
    at = {a: i for i, (a, _) in enumerate(ins)}
    spans = []
    for i, (a, text) in enumerate(ins):
        m = re.search(r"BRA .*?0x([0-9a-f]+)", text)
        if m and int(m.group(1), 16) < a and int(m.group(1), 16) in at:
            spans.append((at[int(m.group(1), 16)], i))
    inner = [(s, e) for s, e in spans
             if not any((s2, e2) != (s, e) and s <= s2 and e2 <= e for s2, e2 in spans)]
    out = []
    def regs(tok, n):  # an HMMA's register quads, another instruction's one register
        r = re.match(r"R(\d+)", tok)
        return range(int(r.group(1)), int(r.group(1)) + n) if r else range(0)

    for s, e in inner:
        ops, deps = {}, []
        for _, text in ins[s:e + 1]:
            body = re.sub(r"^@!?U?P\w+\s+", "", text)
            op = body.split()[0]
            base = op.split(".")[0]
            ops[base] = ops.get(base, 0) + 1
            args = [x.strip() for x in body[len(op):].split(",")]
            mma = base == "HMMA" and len(args) >= 4
            deps.append((mma, regs(args[0], 4 if mma else 1) if args else (),
                         regs(args[3], 4) if mma else ()))
        hmma = sum(m for m, _, _ in deps)
        chain = _longest_chain(deps)
        if hmma:
            out.append({"at": hex(ins[s][0]), "instructions": e - s + 1, "HMMA": hmma,
                        "longest HMMA chain": chain,
                        "opcodes": dict(sorted(ops.items(), key=lambda kv: -kv[1]))})
    return out


def write_sass(kernel, folder: str) -> None:
    """``k.cubin`` and its SASS (``k.sass``, the ``cuobjdump -sass`` of Triton's wheel)."""
    import subprocess

    import triton.backends.nvidia.compiler as nvidia

    cubin = os.path.join(folder, "k.cubin")
    with open(cubin, "wb") as f:
        f.write(kernel.asm["cubin"])
    tool = os.path.join(os.path.dirname(nvidia.__file__), "bin", "cuobjdump")
    with open(os.path.join(folder, "k.sass"), "w") as f:
        f.write(subprocess.run([tool, "-sass", cubin], capture_output=True, text=True,
                               check=True).stdout)


if __name__ == "__main__":
    sys.exit(main())
