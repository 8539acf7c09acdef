"""Speculative decoding in the engine: n-gram (prompt lookup) drafts verified with one
TARGET_VERIFY chain forward. Greedy output is identical to plain decoding and to transformers,
on the MHA pool, the hybrid SWA pool and the MLA latent pool, with drafts really accepted
(so the identity is not vacuous); rejected drafts' KV is rewound."""

import json

import pytest
import torch

from aiter_attn.cli import main
from aiter_attn.engine import (Engine, EngineConfig, SamplingParams, build_random_model,
                               compare_outputs, hf_greedy)
from aiter_attn.engine.models import build_engine_model
from aiter_attn.engine.spec_decode import DraftTree, NgramDrafter, SpecDecoder, make_spec_decoder
from aiter_attn.types import AttnArch

_MAX_NEW = 16
_KW = dict(page_size=4, max_batch_size=2, max_context_len=128, max_tokens_per_step=24,
           shuffle_pages_seed=3)


def _prompts(repetitive=(list(range(10, 18)) * 4, [7, 8, 9] * 9)):
    """A random prompt between repetitive ones (on which the random model loops, so prompt
    lookup has something to find)."""
    g = torch.Generator().manual_seed(0)
    return [repetitive[0], torch.randint(3, 512, (25,), generator=g).tolist(), *repetitive[1:]]


@pytest.mark.parametrize("name,arch,repetitive", [
    pytest.param("llama", AttnArch.MHA, (list(range(10, 18)) * 4, [7, 8, 9] * 9),
                 id="llama-MHA"),
    pytest.param("mistral-swa", AttnArch.SWA, ([419] * 20, [224] * 20),
                 id="mistral-window8-SWA-hybrid-pool"),
    pytest.param("deepseek_v2", AttnArch.MLA, ([300] * 20, [50] * 20), id="deepseek_v2-MLA"),
])
def test_ngram_speculative_is_exactly_greedy(name, arch, repetitive):
    hf, _ = build_random_model(name, seed=0)
    model = build_engine_model(hf, max_positions=256)
    prompts = _prompts(repetitive)
    engine = Engine(model, EngineConfig(speculative="ngram", num_draft_tokens=3, **_KW))
    assert engine.runner.config.arch is arch
    assert engine.runner.config.spec.num_draft_tokens == 4
    ours = engine.generate(prompts, SamplingParams(max_new_tokens=_MAX_NEW))
    stats = engine.spec_decoder.stats
    assert stats.verify_forwards > 0 and stats.accepted > 0, stats
    plain = Engine(model, EngineConfig(**_KW)).generate(prompts,
                                                        SamplingParams(max_new_tokens=_MAX_NEW))
    assert not compare_outputs(ours, plain)
    theirs = hf_greedy(hf, prompts, max_new_tokens=_MAX_NEW, stop_token_ids=frozenset())
    diffs = compare_outputs(ours, theirs)
    assert not diffs, "; ".join(d.describe() for d in diffs)
    assert all(len(o) == _MAX_NEW for o in ours)
    # fewer decode forwards than tokens: accepted drafts saved steps; every page came back
    assert engine.kv.allocator.free_pages == engine.kv.num_pages - 1


@pytest.mark.parametrize("tokens,k,expected", [
    pytest.param([1, 2, 3, 9, 1, 2, 3], 2, [9, 1], id="trigram-match"),
    pytest.param([5, 1, 2, 7, 1, 2], 3, [7, 1, 2], id="latest-bigram-match"),
    pytest.param([4, 6, 4, 8, 4], 1, [8], id="unigram-latest"),
    pytest.param([1, 2, 3, 4], 3, [], id="no-repeat"),
    pytest.param([3, 3], 4, [3], id="draft-cut-at-end"),
    pytest.param([1, 2, 1], 0, [], id="k-zero"),
])
def test_ngram_drafter_hand_computed(tokens, k, expected):
    assert NgramDrafter(max_ngram=3).propose(tokens, k) == expected


def test_rejected_drafts_are_rewound():
    """A draft that is always wrong: the KV length goes back to the committed tokens and the
    output is still greedy."""
    hf, _ = build_random_model("llama", seed=0)
    model = build_engine_model(hf, max_positions=256)

    class Wrong(NgramDrafter):
        def propose(self, tokens, k):
            return [0] * k  # token 0 is never argmax here (pad id of the random config)

    engine = Engine(model, EngineConfig(speculative="ngram", num_draft_tokens=2, **_KW))
    engine.spec_decoder.drafter = Wrong()
    prompt = _prompts()[1]
    req = engine.add_request(prompt, SamplingParams(max_new_tokens=6))
    while engine.has_work:
        engine.step()
        if req.row is not None:
            assert engine.kv.allocator.tokens_held(req.row) == req.num_computed
            assert req.num_computed == req.num_tokens - 1
    assert engine.spec_decoder.stats.accepted == 0 < engine.spec_decoder.stats.proposed
    plain = Engine(model, EngineConfig(**_KW)).generate([prompt], SamplingParams(max_new_tokens=6))
    assert [req.output_ids] == plain


@pytest.mark.parametrize("kwargs,match", [
    pytest.param(dict(speculative="eagle"), "not a speculative mode", id="unknown-mode"),
    pytest.param(dict(speculative="ngram", num_draft_tokens=0), "num_draft_tokens",
                 id="zero-drafts"),
])
def test_bad_speculative_settings_raise(kwargs, match):
    with pytest.raises(ValueError, match=match):
        make_spec_decoder(EngineConfig(**kwargs))


def test_spec_decoder_sizes_the_verify_backend():
    assert SpecDecoder(5).backend_spec.num_draft_tokens == 6
    assert make_spec_decoder(EngineConfig()) is None


def test_generate_cli_speculative_check(capsys):
    rc = main(["generate", "--no-progress", "--json", "--random-config", "llama", "--check",
               "--speculative", "ngram", "--num-draft-tokens", "3", "--prompt",
               "abcabcabcabcabcabc", "--prompt", "hello hello hello", "--max-new-tokens", "12",
               "--page-size", "4", "--no-chat-template"])
    out = json.loads(capsys.readouterr().out)
    assert rc == 0 and out["check"]["passed"]
    spec = out["speculative"]
    assert spec["mode"] == "ngram" and spec["num_draft_tokens"] == 3
    assert spec["proposed"] >= spec["accepted"] >= 0  # acceptance: the engine tests above


@pytest.mark.parametrize("name", [
    pytest.param("llama", id="llama-MHA"),
    pytest.param("mistral-swa", id="mistral-window8-SWA-hybrid-pool"),
    pytest.param("deepseek_v2", id="deepseek_v2-MLA"),
])
def test_tree_drafts_accepting_a_side_branch_move_its_kv(name):
    """Tree verify (topk = 2, custom mask): the first branch is always wrong and the second is
    the true greedy continuation, so every accepted path goes through the side branch and its
    KV must be copied into place; the output stays exactly greedy."""
    hf, _ = build_random_model(name, seed=0)
    model = build_engine_model(hf, max_positions=256)
    prompts = _prompts(([5] * 20, [9, 10] * 6))
    plain = Engine(model, EngineConfig(**_KW)).generate(prompts,
                                                        SamplingParams(max_new_tokens=_MAX_NEW))
    full = [p + o for p, o in zip(prompts, plain)]

    class Oracle(NgramDrafter):
        def propose_many(self, tokens, k, n_chains):
            ref = next(f for f in full if f[:len(tokens)] == list(tokens))
            right = ref[len(tokens):len(tokens) + k - 1]
            return [[(right[0] + 1) % 512], right] if right else []

    engine = Engine(model, EngineConfig(speculative="ngram-tree", num_draft_tokens=4, **_KW))
    engine.spec_decoder.drafter = Oracle()
    assert engine.runner.config.spec.topk == 2
    ours = engine.generate(prompts, SamplingParams(max_new_tokens=_MAX_NEW))
    stats = engine.spec_decoder.stats
    assert stats.moved > 0 and stats.accepted > 0, stats
    assert ours == plain
    assert engine.kv.allocator.free_pages == engine.kv.num_pages - 1


def test_draft_tree_hand_computed():
    tree = DraftTree.from_chains(7, [[1, 2, 3], [1, 4], [5]], max_nodes=4)
    assert tree.tokens == (7, 1, 2, 3, 4) and tree.parents == (-1, 0, 1, 2, 1)
    assert tree.depths() == [0, 1, 2, 3, 2]
    m = tree.ancestor_mask()
    assert m[4].tolist() == [True, True, False, False, True]
    assert m[3].tolist() == [True, True, True, True, False]
    assert tree.accept([1, 4, 0, 0, 6]) == ([1, 4], 6)
    assert tree.accept([9, 0, 0, 0, 0]) == ([], 9)
