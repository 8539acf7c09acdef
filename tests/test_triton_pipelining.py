"""Pipelining guards: our kernels compiled for sm_90 (on any host: Triton's wheel carries
ptxas) must keep their K/V copies in flight while a tile computes.

Triton's software pipeliner issues a tile's copies only one iteration ahead when their
addresses come from a load in the same iteration (``async_wait {num = 0}`` at the loop top:
no copy overlaps the tile's math). The chunked block-table lookup of ``paged_attention``
and the separate value load of fp8 MLA exist to avoid that; these tests fail if a change
brings it back. They compile in a subprocess without ``TRITON_INTERPRET`` (the interpreter
replaces the kernels). Measured effect on the H200: ``docs/triton_tuning.md``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _inspect(kernel: str, config: dict) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    res = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "inspect_sm90.py"), kernel, json.dumps(config),
         "--json"], capture_output=True, text=True, env=env, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    return json.loads(res.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("config", [
    pytest.param(dict(BLOCK_N=128, PAGE_SIZE=16, PAGE_CHUNK=16), id="prefill-page16"),
    pytest.param(dict(BLOCK_N=64, PAGE_SIZE=128, PAGE_CHUNK=16), id="prefill-tile-in-page"),
])
def test_chunked_page_lookup_keeps_two_tiles_in_flight(config):
    rep = _inspect("paged", dict(config, warps=8, stages=3))
    waits = [int(n) for n in rep["async_wait per loop"]]
    assert max(waits) >= 2, rep  # the unmasked key loop: 2 tiles in flight with 3 stages


def test_fp8_mla_value_load_is_pipelined():
    rep = _inspect("mla", dict(kv="fp8e4nv", BLOCK_H=16, BLOCK_N=64, warps=4, stages=3))
    assert max(int(n) for n in rep["async_wait per loop"]) >= 2, rep
    assert rep["ld.global"] < rep["cp.async (16 B)"], rep  # latent rows come via cp.async


#: ptxas spills (cubin stack bytes, ``cuobjdump -res-usage``) of the launches the library
#: picks on an H200 (``"launched"``: the real chooser), at most what they were on 2026-12-04.
#: Zero must stay zero; the rows that spill are #14's register-pressure evidence
#: (docs/triton_tuning.md, "Registers and spills"): a change may lower them, never raise them.
#: (The PTX cannot show spills: ptxas allocates the registers.)
SPILL_CEILINGS = [
    # 1x4k (16 splits of two key tiles) takes the chunked page lookup (chunks of 4 tiles)
    # since 2026-12-04: 80 spilled bytes against 8 per tile, and faster on the H200 (1.55
    # against 1.39 TB/s)
    pytest.param("paged", dict(launched="1x4096"), 80, id="decode-bf16-1x4k"),
    pytest.param("paged", dict(launched="1x4096", PREFETCH_PAGES=True), 80,
                 id="decode-bf16-1x4k-prefetch"),
    pytest.param("paged", dict(launched="1x4096", PAGE_CHUNK=0, PREFETCH_PAGES=False), 8,
                 id="decode-bf16-1x4k-per-tile-lookup"),
    pytest.param("paged", dict(launched="64x4096"), 0, id="decode-bf16-64x4k"),
    pytest.param("paged", dict(launched="64x16384", kv="fp8e4nv"), 216, id="decode-fp8-64x16k"),
    # fp8 values read as 16-bit column pairs (V_PAIRS, TUNING_OVERRIDES["v_pairs"])
    pytest.param("paged", dict(launched="64x16384", kv="fp8e4nv", V_PAIRS=True), 32,
                 id="decode-fp8-64x16k-value-pairs"),
    # 24 (was 16 before the launched builds specialised the per-launch ints as Triton's
    # launcher does: q_blocks_per_seq = 1 a constant, bt_width a multiple of 16; the device
    # build's cubin has the same registers as this one, 2026-12-04)
    pytest.param("paged", dict(launched="8x65536", kv="fp8e4nv", V_PAIRS=True), 24,
                 id="decode-fp8-8x64k-value-pairs"),
    pytest.param("paged", dict(launched="8x2048", q_len=2048), 0, id="prefill-8x2k"),
    pytest.param("paged", dict(launched="1x8192", q_len=8192), 72, id="prefill-1x8k"),
    pytest.param("mla", dict(BLOCK_H=16, BLOCK_N=64, warps=4, stages=3), 56,
                 id="mla-16h-64key"),
    # the 16-head default since 2026-12-04: 32-key tiles (180 registers)
    pytest.param("mla", dict(BLOCK_H=16, BLOCK_N=32, warps=4, stages=3), 0,
                 id="mla-16h-default"),
    pytest.param("mla", dict(BLOCK_H=16, BLOCK_N=64, warps=8, stages=3), 0,
                 id="mla-16h-8warps"),
    pytest.param("mla", dict(BLOCK_H=64, BLOCK_N=64, warps=8, stages=2), 40,
                 id="mla-128h-default"),
    # the 16-head options timed next: tiles through descriptors, the lazy rescale, 16-bit
    # partials, two score chains (241-255 registers: two 4-warp programs per SM still fit)
    pytest.param("mla", dict(BLOCK_H=16, BLOCK_N=32, warps=4, stages=3, NUM_SPLITS=4,
                             ONE_QUERY=True, KV_DESC=True, LAZY_RESCALE=True), 0,
                 id="mla-16h-desc-lazy"),
    pytest.param("mla", dict(BLOCK_H=16, BLOCK_N=32, warps=4, stages=3, NUM_SPLITS=4,
                             ONE_QUERY=True, KV_DESC=True, LAZY_RESCALE=True, part="bf16"), 0,
                 id="mla-16h-desc-lazy-half"),
    pytest.param("mla", dict(BLOCK_H=16, BLOCK_N=32, warps=4, stages=3, NUM_SPLITS=4,
                             ONE_QUERY=True, KV_DESC=True, LAZY_RESCALE=True, part="bf16",
                             QK_SPLIT=2), 0, id="mla-16h-desc-lazy-half-qk-split"),
    # four score chains on pointer loads (168 registers, as the default)
    pytest.param("mla", dict(BLOCK_H=16, BLOCK_N=32, warps=4, stages=3, NUM_SPLITS=4,
                             ONE_QUERY=True, LAZY_RESCALE=True, part="bf16", QK_SPLIT=4), 0,
                 id="mla-16h-lazy-half-qk-split4"),
]


@pytest.mark.parametrize("extra", [{}, dict(KV_DESC=True, LAZY_RESCALE=True)],
                         ids=["pointer-loads", "descriptors-lazy"])
def test_mla_qk_split_shortens_the_score_chain(extra):
    """16 heads: each warp's scores are one m16n8 accumulator over the 576 latent columns, a
    chain of 36 dependent mma.sync a tile (each waits the previous one's latency); with
    ``QK_SPLIT=2`` the two halves (256, 256 + 64 rope: the rope is a third chain) accumulate
    side by side: 16 deep; with ``QK_SPLIT=4`` the quarters: 8 deep. The mma count stays
    (36 + 32 a tile)."""
    cfg = dict(BLOCK_H=16, BLOCK_N=32, warps=4, stages=3, NUM_SPLITS=4, ONE_QUERY=True,
               **extra)
    one = _inspect("mla", cfg)
    assert one["longest mma.sync chain"] == 36, one
    for parts, chain in ((2, 16), (4, 8)):
        rep = _inspect("mla", dict(cfg, QK_SPLIT=parts))
        assert rep["longest mma.sync chain"] == chain, (parts, rep)
        assert rep["mma.sync"] == one["mma.sync"], (parts, one, rep)
        assert rep["stack bytes (ptxas spills)"] == 0 and rep["registers"] <= 255, (parts, rep)


@pytest.mark.parametrize("kernel,config,ceiling", SPILL_CEILINGS)
def test_register_spills_do_not_grow(kernel, config, ceiling):
    rep = _inspect(kernel, config)
    assert 0 < rep["registers"] <= 255, rep
    assert rep["stack bytes (ptxas spills)"] <= ceiling, rep


#: bf16 decode on the per-tile lookup: 4 warps and 74 KB of shared memory per program, so at
#: most 170 registers keep three programs on an SM. 8x64k and 16x4k have 2.4-2.9 programs per
#: SM: at 178 registers (a kernel argument added in the middle of the int arguments, same
#: PTX otherwise) the H200 ran them at 2.97 TB/s where 168 registers gave 4.28 / 3.63.
#: (16x4k measured so; since it runs unsplit on the carried lookup, 12x4k stands for it.)
#: 1x32k: a batch of one, whose num_seqs = 1 Triton would make a constant (178 registers)
#: unless the kernel says ``do_not_specialize`` (its default launch takes slot addressing,
#: 213 registers at two programs per SM: here without it).
THREE_PER_SM = [pytest.param("8x65536", {}, id="8x64k"),
                pytest.param("12x4096", {}, id="12x4k"),
                pytest.param("1x32768", {"FLAT_SLOTS": False}, id="1x32k")]


@pytest.mark.parametrize("launched,extra", THREE_PER_SM)
def test_split_decode_keeps_three_programs_per_sm(launched, extra):
    rep = _inspect("paged", dict(launched=launched, **extra))
    assert rep["registers"] <= 168 and rep["stack bytes (ptxas spills)"] == 0, rep
    assert 3 * rep["shared_bytes"] <= 232448 - 3 * 1024, rep


@pytest.mark.parametrize("launched", ["1x4096", "1x32768", "64x4096"])
def test_slot_addressing_builds_without_spills(launched):
    """Launches that take slot-index addressing (at most two programs per SM launched, or no
    splits): no spills (1x4k's default spilled 80 B without it), two programs per SM."""
    rep = _inspect("paged", dict(launched=launched))
    assert rep["stack bytes (ptxas spills)"] == 0, rep
    assert rep["registers"] * 128 * 2 <= 65536, rep


def test_one_wave_decode_pipelines_two_tiles_ahead():
    """16x4k (one wave, no splits) takes the carried lookup: K/V copies two tiles ahead in
    its unmasked loop, the ring within the H200's shared memory, no spills."""
    rep = _inspect("paged", dict(launched="16x4096"))
    assert max(int(n) for n in rep["async_wait per loop"]) >= 2, rep
    assert rep["shared_bytes"] <= 232448 and rep["stack bytes (ptxas spills)"] == 0, rep


@pytest.mark.parametrize("kernel,config", [
    pytest.param("paged", dict(launched="1x4096", PDL=True), id="decode-split"),
    pytest.param("paged", dict(launched="8x2048", q_len=2048, PDL=True), id="prefill"),
    pytest.param("mla", dict(PDL=True), id="mla"),
])
def test_programmatic_dependent_launch_waits_before_reading(kernel, config):
    """With programmatic dependent launch (a tuning option) the kernel may start while the
    one before it (the K/V write) runs, so ``griddepcontrol.wait`` must come before its
    first global read."""
    rep = _inspect(kernel, config)
    assert rep["gdc wait before first read"] is True, rep


def test_fp8_mla_value_pairs_read_no_single_bytes():
    """The MLA kernel's fp8 latent values likewise (16 heads, 32-key tiles, 3 stages: 128
    byte-wise shared loads, 40 spilled bytes): as column pairs none of either, the same
    shared memory, the latent copies still pipelined."""
    cfg = dict(kv="fp8e4nv", BLOCK_H=16, BLOCK_N=32, warps=4, stages=3)
    plain = _inspect("mla", dict(cfg, V_PAIRS=False))
    paired = _inspect("mla", dict(cfg, V_PAIRS=True))
    assert plain["8-bit shared loads"] > 0, plain
    assert paired["8-bit shared loads"] == 0, paired
    assert paired["stack bytes (ptxas spills)"] == 0, paired
    assert paired["shared_bytes"] <= plain["shared_bytes"], (plain, paired)
    assert max(int(n) for n in paired["async_wait per loop"]) >= 2, paired


@pytest.mark.parametrize("launched", ["64x16384", "8x65536"])
def test_fp8_value_pairs_read_no_single_bytes(launched):
    """An fp8 decode tile's transposed value operand is read byte by byte from shared memory
    by mma.sync (384 ``ld.shared.b8`` at 64x16k); read as 16-bit column pairs it goes through
    ``ldmatrix.trans`` instead, with no 8-bit shared load left and no more shared memory."""
    plain = _inspect("paged", dict(launched=launched, kv="fp8e4nv", V_PAIRS=False))
    paired = _inspect("paged", dict(launched=launched, kv="fp8e4nv", V_PAIRS=True))
    assert plain["8-bit shared loads"] > 0, plain  # what the pairs remove
    assert paired["8-bit shared loads"] == 0, paired
    assert paired["ldmatrix"] > plain["ldmatrix"], (plain, paired)
    assert paired["shared_bytes"] <= plain["shared_bytes"], (plain, paired)
    assert max(int(n) for n in paired["async_wait per loop"]) >= 2, paired


@pytest.mark.parametrize("launched,q_len,loads", [
    pytest.param("1x4096", 1, 4, id="split-decode-prefetch"),
    pytest.param("1x4096", 1, 3, id="split-decode-no-prefetch"),
    pytest.param("8x2048", 2048, 3, id="prefill"),
])
def test_index_loads_leave_in_one_round_trip(launched, q_len, loads):
    """A program's first global reads (its request's ``cu_seqlens_q`` pair and
    ``seqused_k``, and with ``PREFETCH_PAGES`` its first chunk's page ids) go out together,
    before the early exit of empty query blocks: K/V then wait on one round trip (two
    without the prefetch), not three (a load after a branch stays after it in the PTX).
    Small-batch decode is latency-bound, so this chain is its critical path."""
    config = dict(launched=launched, q_len=q_len)
    if q_len == 1:  # the library's own launch, with or without the prefetch (an option)
        config["PREFETCH_PAGES"] = loads == 4
    rep = _inspect("paged", config)
    assert rep["ld.global before the first branch"] == loads, rep


@pytest.mark.parametrize("launched,kv", [
    pytest.param("16x4096", "bf16", id="16x4k"),
    pytest.param("1x32768", "bf16", id="1x32k"),
    pytest.param("64x4096", "bf16", id="64x4k"),
])
def test_carried_page_lookup_keeps_two_tiles_in_flight(launched, kv):
    """The per-tile lookup (these launches' default) waits for every copy before a tile
    computes (``async_wait {num = 0}`` in every loop); with the page ids carried a tile ahead
    (``PAGE_AHEAD``) the pipeliner keeps two tiles of K/V in flight (``num = 2``), with no
    spills (it then allocates the whole 3-stage ring: 136 KB where the per-tile lookup used
    73 KB). Carrying the ids as int64 made the pipeliner give up."""
    plain = _inspect("paged", dict(launched=launched, kv=kv, PAGE_AHEAD=False))
    carried = _inspect("paged", dict(launched=launched, kv=kv, PAGE_AHEAD=True))
    assert max(int(n) for n in plain["async_wait per loop"]) == 0, plain
    assert max(int(n) for n in carried["async_wait per loop"]) >= 2, carried
    assert carried["stack bytes (ptxas spills)"] == 0, carried
    assert carried["registers"] <= max(plain["registers"], 224), (plain, carried)


@pytest.mark.parametrize("kernel,config", [
    pytest.param("reduce", dict(SPLITS_PAD=4), id="paged-4"),
    pytest.param("reduce", dict(SPLITS_PAD=16), id="paged-16"),
    pytest.param("reduce", dict(SPLITS_PAD=64), id="paged-64"),  # 1x32k: 33 splits
    pytest.param("mla_merge", dict(NUM_SPLITS=4, BLOCK_S=4), id="mla-4"),
    pytest.param("mla_merge", dict(NUM_SPLITS=16, BLOCK_S=16), id="mla-16"),
    pytest.param("mla_merge", dict(NUM_SPLITS=4, BLOCK_S=4, part="bf16"), id="mla-4-half"),
])
def test_split_reduction_reads_in_one_round_trip(kernel, config):
    """The split reductions' (max, sum) and accumulator loads all go out before their first
    CTA barrier (the max's cross-warp reduction): one global round trip per launch, not two
    (a load after ``bar.sync`` waits for what comes before it; at 64 splits the paged one
    read its accumulators after it until 2026-12-04)."""
    rep = _inspect(kernel, config)
    assert rep["ld.global"] > 0, rep
    assert rep["ld.global before the first bar.sync"] == rep["ld.global"], rep


@pytest.mark.parametrize("part,vectors", [("fp32", 16), ("bf16", 8)])
def test_mla_split_partials_are_stored_as_16_byte_vectors(part, vectors):
    """A 16-head program's ``[16, 512]`` partial row block, 64 values a thread, leaves as
    16-byte vector stores in both dtypes (16 of float32, 8 of bf16: the 16-bit view of the
    float32 workspace keeps the 16-byte alignment); the one narrower store is the LSE."""
    rep = _inspect("mla", dict(BLOCK_N=32, warps=4, stages=3, NUM_SPLITS=4, ONE_QUERY=True,
                               part=part))
    assert rep["st.global 16 B"] == vectors and rep["st.global narrower"] == 1, rep


def test_sass_loops_counts_the_innermost_loop_and_its_hmma_chain():
    """``inspect_sm90.sass_loops`` on a hand-written listing: an outer loop around an inner
    one; the inner one's three HMMAs, two chained through their accumulator, one not."""
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        from inspect_sm90 import sass_loops
    finally:
        sys.path.remove(str(ROOT / "scripts"))
    sass = "\n".join(f"        /*{a:04x}*/   {t} ;" for a, t in [
        (0x00, "MOV R1, RZ"),
        (0x10, "LDSM.16.M88.4 R4, [R2]"),
        (0x20, "HMMA.16816.F32.BF16 R8, R4, R6, RZ"),
        (0x30, "HMMA.16816.F32.BF16 R8, R4, R6, R8"),
        (0x40, "HMMA.16816.F32.BF16 R12, R4, R6, RZ"),
        (0x50, "@P0 BRA 0x10"),
        (0x60, "IADD3 R1, R1, 0x1, RZ"),
        (0x70, "@P1 BRA 0x0"),
    ])
    loops = sass_loops(sass)
    assert len(loops) == 1, loops
    lp = loops[0]
    assert lp["at"] == "0x10" and lp["instructions"] == 5 and lp["HMMA"] == 3, lp
    assert lp["longest HMMA chain"] == 2 and lp["opcodes"]["LDSM"] == 1, lp
