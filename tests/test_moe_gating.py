"""MoE router: capacity, top-1/top-2/top-k gating (DeepSpeed-MoE's rules) and the Router module.

Expected values come from the written rules, worked out by hand or by the naive per-token loops
below, never from the router's own helpers.
"""

import itertools
import math

import pytest
import torch

from megatron.errors import ConfigError
from megatron.model.moe.config import MoEConfig
from megatron.model.moe.router import Router, capacity, topk_gating

EPS32 = torch.finfo(torch.float32).eps


def softmax_rows(logits):
    """Plain-Python softmax of each row, in double precision."""
    out = []
    for row in logits:
        m = max(row)
        ex = [math.exp(v - m) for v in row]
        out.append([v / sum(ex) for v in ex])
    return out


def argmax(values, skip=None):
    best = None
    for i, v in enumerate(values):
        if i != skip and (best is None or v > values[best]):
            best = i
    return best


def mean_gates(probs):
    S, E = len(probs), len(probs[0])
    return [sum(probs[s][e] for s in range(S)) / S for e in range(E)]


def assert_gating(g, l_aux, ids, gates, positions, tokens_per_expert):
    assert torch.equal(g.expert_ids, torch.tensor(ids, dtype=torch.long))
    assert torch.equal(g.positions, torch.tensor(positions, dtype=torch.long))
    assert torch.equal(g.tokens_per_expert, torch.tensor(tokens_per_expert, dtype=torch.long))
    assert g.gates.dtype == torch.float32
    torch.testing.assert_close(g.gates, torch.tensor(gates, dtype=torch.float32), atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(g.l_aux.float(), torch.tensor(l_aux, dtype=torch.float32), atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize(
    "args, expected",
    [
        ((8, 4, 1, 1.0, 0), 2),  # exact: no spurious round-up
        ((16, 4, 2, 1.0, 4), 8),  # k counts: 2 * 16 / 4
        ((7, 3, 1, 1.0, 1), 3),  # ceil(2.33)
        ((10, 4, 2, 1.25, 1), 7),  # ceil(6.25)
        ((100, 8, 1, 0.5, 4), 7),  # ceil(6.25) beats min 4
        ((8, 4, 1, 1.0, 4), 4),  # min_capacity wins over 2
        ((3, 8, 1, 1.0, 0), 1),  # ceil(0.375)
        ((8, 4, 1, 1.5, 0), 3),  # exact 3.0
        ((100, 1, 1, 1.1, 0), 110),  # DeepSpeed's float32 product: 110 exactly (float64 gives 110.00000000000001)
        ((100, 2, 1, 1.2, 0), 61),  # and float32(1.2) x 50 rounds up past 60 (float64 gives 60)
    ],
)
def test_capacity(args, expected):
    assert capacity(*args) == expected


def test_capacity_equals_deepspeeds_float32_formula_everywhere():
    """DeepSpeed: torch.ceil((num_tokens / num_experts) * torch.tensor(capacity_factor * k)), a float32 product."""
    for tokens in range(1, 3000, 13):
        for experts, k, factor in itertools.product((1, 2, 3, 8, 64), (1, 2, 4), (0.5, 1.0, 1.1, 1.2, 1.25, 1.3, 2.0)):
            deepspeed = int(torch.ceil((tokens / experts) * torch.tensor(factor * k)))
            assert capacity(tokens, experts, k, factor, 0) == deepspeed, (tokens, experts, k, factor)


def test_top1_drops_later_tokens_of_overloaded_expert():
    # S=7, E=3, cf=1 -> C = ceil(7/3) = 3; expert 0 is chosen by tokens 0, 2, 3, 5 -> token 5 dropped
    logits = [[2, 0, 0], [0, 1, 0], [1, 0, 0], [3, 0, 1], [0, 0, 2], [2, 1, 0], [0, 2, 1]]
    g = topk_gating(torch.tensor(logits, dtype=torch.float32), 1, 1.0, 1)
    p = softmax_rows(logits)
    ids = [0, 1, 0, 0, 2, 0, 1]
    gates = [[p[s][ids[s]]] for s in range(7)]
    gates[5] = [0.0]
    me = mean_gates(p)
    l_aux = 3 * (me[0] * 4 / 7 + me[1] * 2 / 7 + me[2] * 1 / 7)
    assert_gating(g, l_aux, [[e] for e in ids], gates, [[0], [0], [1], [2], [0], [-1], [1]], [4, 2, 1])


def test_top1_random_token_selection():
    # E=2, S=8, cf=0.5 -> C = 2; expert 0 chosen by 6 tokens, expert 1 by tokens 2 and 5
    logits = torch.tensor([[1.0, 0.0]] * 8)
    logits[2] = logits[5] = torch.tensor([0.0, 1.0])
    p0 = math.exp(1) / (math.exp(1) + 1)
    kept_sets = set()
    for seed in range(40):
        torch.manual_seed(seed)
        g = topk_gating(logits, 1, 0.5, 1, use_rts=True)
        assert torch.equal(g.tokens_per_expert, torch.tensor([6, 2]))
        kept = [s for s in range(8) if g.positions[s, 0] >= 0]
        kept0 = [s for s in kept if s not in (2, 5)]
        assert len(kept0) == 2 and 2 in kept and 5 in kept
        for e in (0, 1):  # slot = rank among kept tokens of the expert, by token order
            mine = [s for s in kept if g.expert_ids[s, 0] == e]
            assert [int(g.positions[s, 0]) for s in mine] == list(range(len(mine)))
        for s in range(8):
            expected = p0 if s in kept else 0.0
            assert abs(float(g.gates[s, 0]) - expected) < 1e-6
        kept_sets.add(tuple(kept0))
    assert len(kept_sets) > 3 and kept_sets != {(0, 1)}


def test_top2_positions_offsets_and_renormalisation():
    # S=4, E=3, k=2, cf=0.5 -> C = ceil(2*4/3*0.5) = 2
    logits = [[3, 1, 0], [2, 0, 1], [4, 2, 0], [1, 2, 0]]
    # first choices 0,0,0,1 -> slots 0,1,2(drop) | 0;  first counts [3, 1, 0]
    # second choices 1,2,1,0 -> e1: 1+0=1, 1+1=2(drop); e2: 0+0=0; e0: 3+0=3(drop)
    g = topk_gating(torch.tensor(logits, dtype=torch.float32), 2, 0.5, 1)
    p = softmax_rows(logits)
    ids = [[0, 1], [0, 2], [0, 1], [1, 0]]
    positions = [[0, 1], [1, 0], [-1, -1], [0, -1]]
    gates = [
        [p[s][ids[s][0]] / (p[s][ids[s][0]] + p[s][ids[s][1]]), p[s][ids[s][1]] / (p[s][ids[s][0]] + p[s][ids[s][1]])]
        for s in (0, 1)
    ]
    gates += [[0.0, 0.0], [1.0, 0.0]]
    me = mean_gates(p)
    l_aux = 3 * (me[0] * 3 / 4 + me[1] * 1 / 4)
    assert_gating(g, l_aux, ids, gates, positions, [4, 3, 1])


def test_top3_drops_by_probability():
    # S=4, E=4, k=3, cf=0.5 -> C = ceil(3*4/4*0.5) = 2
    logits = [[1, 2, 3, -5], [3, 1, 0.5, -5], [2, 3, -5, 1], [-5, 2.5, 3, 0]]
    p = softmax_rows(logits)
    # probabilities (approx.): t0 e2 .665 e1 .245 e0 .090 | t1 e0 .821 e1 .111 e2 .067
    #                          t2 e1 .665 e0 .245 e3 .090 | t3 e2 .604 e1 .366 e3 .030
    # e0: t1, t2 kept, t0 (earlier, lower) dropped;  e1: t2, t3 kept, t0 and t1 dropped
    # e2: t0, t3 kept, t1 dropped;  e3: only t2, t3 -> both kept
    ids = [[2, 1, 0], [0, 1, 2], [1, 0, 3], [2, 1, 3]]
    positions = [[0, -1, -1], [0, -1, -1], [0, 1, 0], [1, 1, 1]]
    gates = [[1.0, 0.0, 0.0], [1.0, 0.0, 0.0]]
    for s in (2, 3):
        total = sum(p[s][e] for e in ids[s])
        gates.append([p[s][e] / total for e in ids[s]])
    me = mean_gates(p)
    counts = [3, 4, 3, 2]
    l_aux = 4 * sum(me[e] * counts[e] / 4 for e in range(4)) / 3
    g = topk_gating(torch.tensor(logits, dtype=torch.float32), 3, 0.5, 1)
    assert_gating(g, l_aux, ids, gates, positions, counts)


def test_top3_position_policy_keeps_earliest_tokens():
    # The logits of test_top3_drops_by_probability, C = 2, with DeepSpeed's drop_policy="position":
    # each expert keeps the first two tokens that chose it, whatever their probabilities.
    logits = [[1, 2, 3, -5], [3, 1, 0.5, -5], [2, 3, -5, 1], [-5, 2.5, 3, 0]]
    p = softmax_rows(logits)
    # e0: t0, t1 kept, t2 dropped;  e1: t0, t1 kept, t2 and t3 dropped;  e2: t0, t1 kept, t3 dropped
    # e3: t2, t3 kept
    ids = [[2, 1, 0], [0, 1, 2], [1, 0, 3], [2, 1, 3]]
    positions = [[0, 0, 0], [1, 1, 1], [-1, -1, 0], [-1, -1, 1]]
    gates = [[p[s][e] / sum(p[s][e] for e in ids[s]) for e in ids[s]] for s in (0, 1)]
    gates += [[0.0, 0.0, 1.0], [0.0, 0.0, 1.0]]
    me = mean_gates(p)
    counts = [3, 4, 3, 2]
    l_aux = 4 * sum(me[e] * counts[e] / 4 for e in range(4)) / 3
    g = topk_gating(torch.tensor(logits, dtype=torch.float32), 3, 0.5, 1, drop_policy="position")
    assert_gating(g, l_aux, ids, gates, positions, counts)


def naive_topk_position(logits, k, C):
    """DeepSpeed's topkgating with drop_policy="position", one token at a time."""
    S, E = len(logits), len(logits[0])
    p = softmax_rows(logits)
    ids, gates, pos, filled = [], [], [], [0] * E
    for s in range(S):
        chosen = sorted(range(E), key=lambda e: -p[s][e])[:k]
        slots = [filled[e] if filled[e] < C else -1 for e in chosen]
        for e in chosen:
            filled[e] += 1
        kept = [p[s][e] if slot >= 0 else 0.0 for e, slot in zip(chosen, slots)]
        denom = max(sum(kept), EPS32)
        ids.append(chosen)
        gates.append([g / denom for g in kept])
        pos.append(slots)
    counts = [sum(row.count(e) for row in ids) for e in range(E)]
    me = mean_gates(p)
    return E * sum(me[e] * counts[e] / S for e in range(E)) / k, ids, gates, pos, counts


@pytest.mark.parametrize("k, C", [(3, 13), (4, 17)])  # C = ceil(k * 50 / 6 * 0.5): 12.5 and 16.67
def test_topk_position_policy_matches_naive_reference(k, C):
    torch.manual_seed(20 + k)
    logits = torch.randn(50, 6) * 1.5
    logits[:, 0] += 1.0  # overload expert 0 so drops happen
    expected = naive_topk_position(logits.tolist(), k, C)
    assert any(-1 in row for row in expected[3])
    g = topk_gating(logits, k, 0.5, 1, drop_policy="position")
    assert_gating(g, *expected)
    assert not torch.equal(g.positions, topk_gating(logits, k, 0.5, 1).positions)  # "probs" drops others


def test_drop_policy_is_checked():
    with pytest.raises(ConfigError, match="unknown MoE drop_policy 'tokens'"):
        MoEConfig(topk=3, drop_policy="tokens")
    with pytest.raises(ConfigError, match="applies to --topk 3 or more"):
        MoEConfig(topk=2, drop_policy="position")
    with pytest.raises(ValueError, match="unknown drop_policy"):  # DeepSpeed's topkgating raises ValueError
        topk_gating(torch.zeros(4, 4), 3, 1.0, 1, drop_policy="tokens")


def test_router_routes_by_the_configured_drop_policy():
    torch.manual_seed(0)
    config = MoEConfig(topk=3, eval_capacity_factor=0.5, min_capacity=1, drop_policy="position")
    router = Router(16, 6, config).eval()
    gating, logits = router(torch.randn(50, 16))
    expected = naive_topk_position(logits.tolist(), 3, 13)  # C = ceil(3 * 50 / 6 * 0.5)
    assert any(-1 in row for row in expected[3])
    assert_gating(gating, *expected)


@pytest.mark.parametrize("k", [1, 2, 3])
def test_dropless_keeps_every_choice(k):
    torch.manual_seed(k)
    logits = torch.randn(64, 8) * 2
    dropped = topk_gating(logits, k, 0.1, 0)
    assert (dropped.positions < 0).any()  # the same capacity does drop
    g = topk_gating(logits, k, 0.1, 0, drop_tokens=False)
    p = softmax_rows(logits.tolist())
    assert (g.positions >= 0).all() and (g.gates > 0).all()
    for e in range(8):  # each expert's slots are 0..n-1 with n = its count
        slots = sorted(g.positions[g.expert_ids == e].tolist())
        assert slots == list(range(int(g.tokens_per_expert[e])))
    assert int(g.tokens_per_expert.sum()) == 64 * k
    for s in range(64):
        chosen = [p[s][e] for e in g.expert_ids[s].tolist()]
        expected = chosen if k == 1 else [c / sum(chosen) for c in chosen]
        torch.testing.assert_close(g.gates[s], torch.tensor(expected, dtype=torch.float32), atol=1e-6, rtol=1e-5)


def naive_top1(logits, C):
    S, E = len(logits), len(logits[0])
    p = softmax_rows(logits)
    ids, gates, pos, filled = [], [], [], [0] * E
    for s in range(S):
        e = argmax(p[s])
        ids.append([e])
        kept = filled[e] < C
        pos.append([filled[e] if kept else -1])
        gates.append([p[s][e] if kept else 0.0])
        filled[e] += kept
    counts = [sum(1 for r in ids if r[0] == e) for e in range(E)]
    me = mean_gates(p)
    return E * sum(me[e] * counts[e] / S for e in range(E)), ids, gates, pos, counts


def naive_top2(logits, C):
    S, E = len(logits), len(logits[0])
    p = softmax_rows(logits)
    first = [argmax(p[s]) for s in range(S)]
    second = [argmax(logits[s], skip=first[s]) for s in range(S)]
    n_first = [first.count(e) for e in range(E)]
    seen1, seen2 = [0] * E, [0] * E
    ids, gates, pos = [], [], []
    for s in range(S):
        e1, e2 = first[s], second[s]
        slot1, slot2 = seen1[e1], n_first[e2] + seen2[e2]
        seen1[e1] += 1
        seen2[e2] += 1
        g1 = p[s][e1] if slot1 < C else 0.0
        g2 = p[s][e2] if slot2 < C else 0.0
        denom = max(g1 + g2, EPS32)
        ids.append([e1, e2])
        gates.append([g1 / denom, g2 / denom])
        pos.append([slot1 if slot1 < C else -1, slot2 if slot2 < C else -1])
    counts = [first.count(e) + second.count(e) for e in range(E)]
    me = mean_gates(p)
    return E * sum(me[e] * n_first[e] / S for e in range(E)), ids, gates, pos, counts


@pytest.mark.parametrize("k, C", [(1, 10), (2, 20)])  # C = ceil(k * 50 / 5 * 1.0)
def test_matches_naive_reference(k, C):
    torch.manual_seed(10 + k)
    logits = torch.randn(50, 5) * 1.5
    logits[:, 0] += 1.0  # overload expert 0 so drops happen
    expected = (naive_top1 if k == 1 else naive_top2)(logits.tolist(), C)
    assert any(-1 in row for row in expected[3])
    assert_gating(topk_gating(logits, k, 1.0, 1), *expected)


def test_router_eval_deterministic_and_fp32_logits():
    torch.manual_seed(0)
    cfg = MoEConfig(
        topk=1,
        noisy_gate_policy="Jitter",
        train_capacity_factor=0.25,
        eval_capacity_factor=2.0,
        min_capacity=1,
        use_rts=True,
    )
    router = Router(16, 4, cfg)
    x = torch.randn(32, 16).bfloat16()
    w = router.weight.detach().double()
    ref = (x.double() @ w.T).float()  # the logits in (more than) fp32
    router.eval()
    torch.manual_seed(1)
    g1, l1 = router(x)
    torch.manual_seed(2)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        g2, l2 = router(x)
    for logits in (l1, l2):
        assert logits.dtype == torch.float32
        torch.testing.assert_close(logits, ref, atol=1e-5, rtol=1e-5)
    assert torch.equal(l1, l2)
    for a, b in zip(g1, g2):
        assert torch.equal(a, b)
    # eval capacity: C = ceil(32/4*2.0) = 16; no noise so choice = argmax of the clean logits
    assert torch.equal(g1.expert_ids[:, 0], ref.argmax(1))
    kept = torch.bincount(g1.expert_ids[g1.positions >= 0], minlength=4)
    assert torch.equal(kept, g1.tokens_per_expert.clamp(max=16))

    router.train()
    torch.manual_seed(3)
    _, lt = router(x)
    bound = 0.01 * (x.double().abs() @ w.abs().T) + 1e-5
    assert not torch.allclose(lt, ref, atol=1e-6, rtol=0) and ((lt.double() - ref.double()).abs() <= bound).all()

    # training with RTS (no jitter): the kept tokens depend on the RNG, C = ceil(32/4*0.25) = 2
    rts = Router(16, 4, MoEConfig(topk=1, train_capacity_factor=0.25, min_capacity=1, use_rts=True))
    rts.load_state_dict(router.state_dict())
    masks = []
    for seed in (0, 0, 1, 2, 3, 4, 5):
        torch.manual_seed(seed)
        masks.append(tuple((rts(x)[0].positions[:, 0] >= 0).tolist()))
    assert masks[0] == masks[1] and len(set(masks)) > 2
    rts.eval()
    assert len({tuple((rts(x)[0].positions[:, 0] >= 0).tolist()) for _ in range(3)}) == 1


def test_rsample_noise_changes_choice_not_gate_values():
    torch.manual_seed(0)
    logits = torch.randn(24, 4) * 0.5
    clean = torch.tensor(softmax_rows(logits.tolist()), dtype=torch.float32)
    differs = 0
    for seed in range(10):
        torch.manual_seed(seed)
        g = topk_gating(logits, 1, 1.0, 1, noisy_gate_policy="RSample")
        e = g.expert_ids[:, 0]
        differs += int((e != clean.argmax(1)).sum())
        kept = g.positions[:, 0] >= 0
        torch.testing.assert_close(g.gates[kept, 0], clean[kept, e[kept]], atol=1e-6, rtol=1e-5)
        assert (g.gates[~kept, 0] == 0).all()
        assert g.tokens_per_expert.tolist() == [e.tolist().count(i) for i in range(4)]
    assert differs > 0
