"""msModelSlim's recipes end to end against its own outputs for the tiny checkpoint (tests/fixtures/
msmodelslim-v1-*): the recipe file run by the quantize job, every tensor compared (the comparison runs in a
child process with the AVX2 kernels the fixtures were made with, tests/msmodelslim_recipe_parity.py).

The goals: every int8 tensor equal, every zero point within one step, everything else within 2%
(quant_bias, an int32 made of the zero point and the bias, follows its input_offset: compared where that is
exact). The floors on exact tensors are what the layer-by-layer passes reach (pipeline.quant.calibration.layer_passes);
the few tensors short of exact come from bf16 roundings of long sums whose order belongs to msModelSlim's
torch build (one FA3 query head in layers 2 and 3, one channel of layer 2's iter_smooth shift), not from a
step of the method."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

from pinned_isa import TESTS, run_pinned

OFFSET_STEPS = 1          # input_offset: at most one step away
FLOAT_REL = 0.02          # every other float tensor: max |ours - theirs| <= 2% of max |theirs|
# Known short of the goal: one channel (47) of layer 2's q_a_layernorm shift under iter_smooth comes out one
# bf16 step off msModelSlim's (a q_a_proj GEMM rounding on their torch build: fp32 sums move it further),
# so q_b_proj's int8 weights there differ by <= 2 in <= 1% of the elements.
INT8_KNOWN = {("iter_smooth", "model.layers.2.self_attn.q_b_proj.weight"): (2, 0.01)}
CASES = {                 # fixture, recipe, products, model dtype -> tensors that must be exact (of 391..406)
    "plain": ("msmodelslim-v1-bf16", "recipe-w8a8-fa3.yaml", "model", "bf16", 389),
    "plain-fp32-products": ("msmodelslim-v1-bf16", "recipe-w8a8-fa3.yaml", "fp32", "bf16", 380),
    "plain-fp16": ("msmodelslim-v1-fp16", "recipe-w8a8-fa3.yaml", "model", "fp16", 389),
    "iter_smooth": ("msmodelslim-v1-bf16-itersmooth", "recipe-itersmooth.yaml", "model", "bf16", 399),
    "flex_smooth": ("msmodelslim-v1-bf16-flexsmooth", "recipe-flexsmooth.yaml", "model", "bf16", 389),
    "quarot-c8": ("msmodelslim-v1-bf16-quarot-c8", "recipe-quarot-c8.yaml", "model", "bf16", 391),
}


#: Children run at once: each runs one torch thread (msmodelslim_recipe_parity.py), so two use two cores
#: while this process waits; each child's output does not depend on what runs beside it.
CHILDREN_AT_ONCE = 2


@pytest.fixture(scope="module")
def runs(request):
    """Every selected case's child, started up front (CHILDREN_AT_ONCE at a time, in the cases' order):
    case name -> a future of its result."""
    wanted = sorted({item.callspec.params["case"] for item in request.session.items
                     if hasattr(item, "callspec") and "case" in item.callspec.params
                     and item.module is request.module})
    pool = ThreadPoolExecutor(max_workers=CHILDREN_AT_ONCE)
    try:
        yield {name: pool.submit(run_pinned, TESTS / "msmodelslim_recipe_parity.py", *CASES[name][:4])
               for name in wanted}
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


@pytest.fixture(scope="module", params=sorted(CASES))
def case(request, runs):
    return request.param, runs[request.param].result(), CASES[request.param][4]


def test_same_tensors_as_msmodelslim(case):
    name, res, floor = case
    assert res["missing"] == [] and res["extra"] == [], name
    assert not [n for n, r in res["tensors"].items() if r["kind"] == "layout"], name


def test_within_the_goals(case):
    name, res, floor = case
    t = res["tensors"]
    for n, r in t.items():
        module = n.rsplit(".", 1)[0]
        if n.endswith(".quant_bias"):  # made of input_offset, deq_scale and the bias: exact when they are
            deps = [module + leaf for leaf in (".input_offset", ".deq_scale", ".bias") if module + leaf in t]
            assert r["exact"] or not all(t[d]["exact"] for d in deps), f"{name}: {n}"
        elif r["kind"] == "int":
            steps, frac = INT8_KNOWN.get((name, n), (0, 0.0))
            assert r["exact"] or (r["diff"] <= steps and r["frac"] <= frac), \
                f"{name}: {n} int8 differs by up to {r['diff']} in {r['frac']:.2%} of its elements"
        elif r["kind"] == "offset":
            assert r["diff"] <= OFFSET_STEPS, f"{name}: {n} is {r['diff']} steps away"
        else:
            assert r["diff"] <= FLOAT_REL, f"{name}: {n} differs by {r['diff']:.4f} of its largest value"


def test_exact_tensors_reach_the_floor(case):
    name, res, floor = case
    exact = sum(r["exact"] for r in res["tensors"].values())
    assert exact >= floor, f"{name}: {exact} of {len(res['tensors'])} tensors exact, expected >= {floor}"


def test_quarot_writes_the_global_rotation_and_its_description_entry(case):
    name, res, _ = case
    if name != "quarot-c8":
        pytest.skip("QuaRot only")
    assert res["optional"] == {"global_rotation": {"kind": "float", "exact": True, "diff": 0.0}}
    assert res["description"]["optional"] == {"quarot": {"rotation_map": {"global_rotation": "optional/quarot.safetensors"}}}
