"""Observers and calibration statistics: the recall window against a brute-force reference, exact and
associative merges, serialisation, padding exclusion, and calibration runs split over samples or layers
merging to the single run bit for bit."""

from __future__ import annotations

import random

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from pipeline.config import DeepseekV3Config
from pipeline.model import build_model
from pipeline.quant.calibration.calibrate import collect_stats
from pipeline.quant.numerics.observers import MinMax, RecallWindow, Stats, recall_window, recall_window_sorted
from pipeline.quant.numerics.qparams import QuantError
from pipeline.quant.recipe.recipe import Recipe
from tests.tiny import random_tensors, tiny_config


def brute_force_window(values: list[float], ratio: float) -> tuple[float, float]:
    """O(N^2), no sorting: over every interval [a, b] with ends among the values and holding at least
    m = max(int(ratio * N), 1) values, the narrowest (float64 width), the lowest a on ties."""
    n = len(values)
    m = max(int(ratio * n), 1)
    best = None
    for a in values:
        for b in values:
            if b < a or sum(a <= v <= b for v in values) < m:
                continue
            key = (b - a, a)
            if best is None or key < best[0]:
                best = (key, (a, b))
    return best[1]


@pytest.mark.parametrize("seed", range(6))
def test_recall_window_matches_brute_force(seed):
    g = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    for _ in range(12):
        n = rng.randint(1, 40)
        if rng.random() < 0.5:  # heavy ties: few distinct values
            rows = torch.randint(-3, 4, (3, n), generator=g).float() * 0.25
        else:
            rows = (torch.randn(3, n, generator=g) * 2).to(torch.bfloat16)
        ratio = rng.choice([1.0, 0.9999, 0.9, 0.5, 0.3, 1e-3])
        lo, hi = recall_window(rows, ratio)
        for r in range(3):
            assert (lo[r], hi[r]) == brute_force_window(rows[r].double().tolist(), ratio), (n, ratio)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_recall_window_from_the_extremes_equals_the_sorted_rows(dtype, monkeypatch):
    """FA3's ratios on rows as long as the embedded model's (S * 512 values): the topk path gives the
    sorted reference's windows bit for bit, ties and duplicated extremes included, in chunks of rows."""
    import pipeline.quant.numerics.observers as obs

    monkeypatch.setattr(obs, "WINDOW_CHUNK", 3 * 20000)   # 3 rows per chunk: a partial last chunk
    g = torch.Generator().manual_seed(7)
    rows = (torch.randn(7, 20000, generator=g) * 3).to(dtype)
    rows[1, :40] = rows[1].max()                                            # many copies of the maximum
    rows[2] = torch.randint(-2, 3, (20000,), generator=g).to(dtype)        # few distinct values: ties
    rows[3, 5], rows[3, 9] = 1e4, -1e4                                      # outliers the window drops
    for ratio in (1.0, 0.9999, 0.999, 0.9, 0.6):
        assert recall_window(rows, ratio) == recall_window_sorted(rows, ratio), (dtype, ratio)


def test_recall_window_edge_cases():
    row = torch.tensor([[5.0, -1.0, 2.0, 100.0, 3.0]])
    assert recall_window(row, 1.0) == ([-1.0], [100.0])                 # ratio 1: plain min/max
    assert recall_window(row, 0.8) == ([-1.0], [5.0])                   # m = 4 drops the outlier
    assert recall_window(row, 0.01) == ([-1.0], [-1.0])                 # m floors at one value
    assert recall_window(torch.tensor([[7.0]]), 0.9999) == ([7.0], [7.0])
    assert recall_window(torch.tensor([[1.0, 1.0, 1.0]]), 0.5) == ([1.0], [1.0])
    # 0.9999 of N < 10000 values is N - 1: exactly one extreme value is dropped
    x = torch.cat([torch.linspace(0, 1, 999), torch.tensor([50.0])]).unsqueeze(0)
    assert recall_window(x, 0.9999) == ([0.0], [1.0])


def test_recall_window_bad_inputs():
    with pytest.raises(QuantError, match="fa_q: ratio must be a number in \\(0, 1\\]"):
        recall_window(torch.zeros(1, 4), 0.0, name="fa_q")
    with pytest.raises(QuantError, match="ratio must be a number"):
        RecallWindow(1.5)
    with pytest.raises(QuantError, match="fa_k: 1 non-finite"):
        recall_window(torch.tensor([[0.0, float("nan")]]), 1.0, name="fa_k")
    with pytest.raises(QuantError, match="fa_k: expected 2 dims"):
        recall_window(torch.zeros(4), 1.0, name="fa_k")


def _fold(stats: list, order: list[int], cuts: list[int]):
    """Merge ``stats`` in ``order``, first within the groups cut at ``cuts``, then the groups."""
    items = [stats[i] for i in order]
    bounds = [0, *cuts, len(items)]
    groups = []
    for a, b in zip(bounds, bounds[1:]):
        acc = items[a]
        for s in items[a + 1:b]:
            acc = acc.merge(s)
        groups.append(acc)
    acc = groups[-1]
    for s in reversed(groups[:-1]):
        acc = s.merge(acc)
    return acc


@pytest.mark.parametrize("seed", range(5))
def test_merge_is_exact_for_any_split_and_order(seed):
    g = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    samples = [(torch.randn(rng.randint(1, 30), 4, 8, generator=g) * 3).to(torch.bfloat16) for _ in range(9)]
    per_sample = [Stats({
        "a.q_a_proj": MinMax.observe(x),
        "a.fa_q": RecallWindow.observe(x.transpose(0, 1).reshape(4, -1), 0.9999),
        "a.fa_k": RecallWindow.observe(x.reshape(1, -1), 0.9),
    }) for x in samples]
    reference = _fold(per_sample, list(range(9)), []).to_dict()
    for _ in range(10):
        order = rng.sample(range(9), 9)
        cuts = sorted(rng.sample(range(1, 9), rng.randint(0, 4)))
        assert _fold(per_sample, order, cuts).to_dict() == reference
    merged = _fold(per_sample, list(range(9)), [])
    assert merged.minmax("a.q_a_proj").count == sum(x.numel() for x in samples)
    assert merged.window("a.fa_q").count == 9 and merged.window("a.fa_q").rows == 4


def test_stats_round_trip_through_dict_and_parquet(tmp_path):
    st = Stats({"m.x": MinMax(-1.25, 3.0, 10),
                "m.fa_q": RecallWindow(0.9999, (-0.1, -0.2), (0.3, 0.4), 2),
                "m.fa_v": RecallWindow(1.0, (-5e-8,), (7.0,), 2)})
    cols = st.to_dict()
    assert Stats.from_dict(cols) == st
    assert all(isinstance(v, list) for v in cols.values()) and len(cols["name"]) == 4
    pq.write_table(pa.Table.from_pydict(cols), tmp_path / "stats.parquet")
    assert Stats.from_dict(pq.read_table(tmp_path / "stats.parquet").to_pydict()) == st


def test_stats_bad_inputs():
    with pytest.raises(QuantError, match="stats: columns"):
        Stats.from_dict({"name": []})
    cols = Stats({"m.fa_q": RecallWindow(0.9999, (0.0, 0.0), (1.0, 1.0), 1)}).to_dict()
    cols["row"][1] = 5
    with pytest.raises(QuantError, match="recall window 'm.fa_q' has bad row indices"):
        Stats.from_dict(cols)
    with pytest.raises(QuantError, match="cannot merge MinMax with RecallWindow"):
        Stats({"a": MinMax(0, 1, 1)}).merge(Stats({"a": RecallWindow(1.0, (0.0,), (1.0,), 1)}))
    with pytest.raises(QuantError, match="ratios 0.9999 and 1.0"):
        RecallWindow(0.9999, (0.0,), (1.0,), 1).merge(RecallWindow(1.0, (0.0,), (1.0,), 1))
    with pytest.raises(QuantError, match="of 2 and 1 rows"):
        RecallWindow(1.0, (0.0, 0.0), (1.0, 1.0), 1).merge(RecallWindow(1.0, (0.0,), (1.0,), 1))
    with pytest.raises(QuantError, match="model.layers.0.self_attn.o_proj: no calibration statistics"):
        Stats().minmax("model.layers.0.self_attn.o_proj")
    with pytest.raises(QuantError, match="m.x: expected a non-empty RecallWindow"):
        Stats({"m.x": MinMax(0, 1, 1)}).window("m.x")


def test_padding_is_excluded():
    x = torch.tensor([[[1.0, -2.0], [3.0, 0.5], [-100.0, 100.0]]])   # [B=1, S=3, k=2]
    mask = torch.tensor([[True, True, False]])                       # the last token is padding
    mm = MinMax.observe(x, mask)
    assert (mm.lo, mm.hi, mm.count) == (-2.0, 3.0, 4)
    assert MinMax.observe(x, torch.zeros(1, 3, dtype=torch.bool)) == MinMax()
    with pytest.raises(QuantError, match="q_a_proj: mask must be bool of shape \\[1, 3\\]"):
        MinMax.observe(x, torch.ones(3, dtype=torch.bool), name="q_a_proj")
    with pytest.raises(QuantError, match="q_a_proj: 1 non-finite"):
        MinMax.observe(torch.tensor([[float("inf")]]), name="q_a_proj")


# ----- calibration on a random tiny model --------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_model():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    cfg = DeepseekV3Config.from_dict(tiny_config())
    model = build_model(cfg, random_tensors(cfg, seed=3), dtype=torch.bfloat16)
    g = torch.Generator().manual_seed(0)
    samples = [torch.randint(0, cfg.vocab_size, (n,), generator=g).tolist() for n in (9, 1, 14, 5)]
    yield model, samples
    torch.set_num_threads(threads)


def test_collect_stats_covers_the_recipe(tiny_model):
    model, samples = tiny_model
    cfg = model.config
    recipe = Recipe(quantize_mtp=True, fa_exclude_layers=(1,))
    st = collect_stats(model, samples, recipe)
    H = cfg.num_attention_heads
    for i in (0, 1, 2, 3):
        p = f"model.layers.{i}.self_attn."
        for lin in ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "o_proj"):
            mm = st.minmax(p + lin)
            assert mm.count > 0 and mm.lo < 0 < mm.hi
        if i == 1:
            assert not any(k.startswith(p + "fa_") for k in st.entries)
        else:
            assert st.window(p + "fa_q").rows == H and st.window(p + "fa_k").rows == 1
            assert st.window(p + "fa_v").count == len(samples) - (i == 3)  # MTP: not the 1-token one
    tokens = sum(len(s) for s in samples)
    assert st.minmax("model.layers.0.self_attn.q_a_proj").count == tokens * cfg.hidden_size
    # the MTP layer sees S - 1 positions per sample (none for a one-token sample)
    assert st.minmax("model.layers.3.self_attn.q_a_proj").count == (tokens - len(samples)) * cfg.hidden_size
    assert st.window("model.layers.3.self_attn.fa_q").count == len(samples) - 1
    # no hook or wrapper is left behind
    assert not any(m._forward_pre_hooks for m in model.modules())
    assert "query" not in vars(model.model.layers[0].self_attn)
    # dynamic: no static linear, FA3 only
    dyn = collect_stats(model, samples[:1], Recipe(dynamic=True))
    assert {k.rsplit(".", 1)[1] for k in dyn.entries} == {"fa_q", "fa_k", "fa_v"}


def test_split_calibration_merges_to_the_single_run(tiny_model):
    model, samples = tiny_model
    recipe = Recipe(quantize_mtp=True)
    full = collect_stats(model, samples, recipe)
    by_samples = collect_stats(model, samples[2:], recipe).merge(collect_stats(model, samples[:2], recipe))
    by_layers = collect_stats(model, samples, recipe, layers=[2, 3]).merge(
        collect_stats(model, samples, recipe, layers=[0, 1]))
    assert by_samples.to_dict() == full.to_dict()
    assert by_layers.to_dict() == full.to_dict()
    assert full.select("model.layers.1.").entries.keys() == by_layers.select("model.layers.1.").entries.keys()


def test_collect_stats_bad_inputs(tiny_model):
    model, samples = tiny_model
    with pytest.raises(QuantError, match="samples\\[1\\]: empty sample"):
        collect_stats(model, [[1, 2], []], Recipe())
    with pytest.raises(QuantError, match="samples\\[0\\]: token ids \\[512\\]"):
        collect_stats(model, [[1, 512]], Recipe())
    with pytest.raises(QuantError, match="samples: no calibration samples"):
        collect_stats(model, [], Recipe())
    with pytest.raises(QuantError, match="layers: 7 is not a layer"):
        collect_stats(model, samples, Recipe(), layers=[7])
    with pytest.raises(QuantError, match="fa_exclude_layers \\[9\\] not in the model"):
        collect_stats(model, samples, Recipe(fa_exclude_layers=(9,)))
