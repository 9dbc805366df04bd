"""What the layer-by-layer jobs hold while they read (pipeline.quant.calibration.layer_reads, CheckpointReader.read_ahead,
calib_linears.FakeQuantWeights): with a local source the next layer goes to the page cache, not into the
process, so one layer is held at a time; the thread read-ahead (object storage) holds two; the passes of a
layer share one set of fake-quantized weights, the same values as quantizing each weight on its own."""

from __future__ import annotations

import time

import torch

from pipeline.io.checkpoint import CheckpointReader
from pipeline.quant.calibration.calib_linears import CalibLinears, DeployedLinears, FakeQuantWeights
from pipeline.quant.calibration.layer_reads import prefetched
from pipeline.quant.numerics.qparams import quantize_weight_per_channel
from tiny import TINY_FIXTURE


class Loads:
    """A load that counts the layers alive at once (a layer is a dict holding one object that says when it goes)."""

    def __init__(self):
        self.alive, self.most, self.order = 0, 0, []

    def __call__(self, i):
        loads = self

        class Layer:
            def __del__(self):
                loads.alive -= 1

        self.alive += 1
        self.most = max(self.most, self.alive)
        self.order.append(i)
        return {"x": Layer()}


def test_a_hint_taken_holds_one_layer_and_hints_each_next_one():
    loads, hinted = Loads(), []
    got = []
    for i, layer in prefetched([0, 1, 2, 3], loads, True, lambda i: hinted.append(i) or True):
        got.append(i)
        del layer
    assert got == [0, 1, 2, 3] and loads.order == [0, 1, 2, 3]
    assert hinted == [0, 1, 2, 3]          # the first before its read, each next one while this one is worked on
    assert loads.most == 1


def test_without_the_hint_a_thread_reads_one_layer_ahead():
    loads = Loads()
    for i, layer in prefetched([0, 1, 2], loads, True, lambda i: False):
        deadline = time.monotonic() + 60
        while len(loads.order) < min(i + 2, 3) and time.monotonic() < deadline:   # the thread's read of the next
            time.sleep(0.01)
        del layer
    assert loads.order == [0, 1, 2] and loads.most == 2
    off = Loads()
    for _, layer in prefetched([0, 1, 2], off, False, lambda i: True):
        del layer
    assert off.most == 1


def test_a_local_checkpoint_takes_the_read_ahead_hint():
    reader = CheckpointReader(str(TINY_FIXTURE))
    assert reader.read_ahead(0) is True
    assert reader.read_ahead(None) is True         # the globals


def test_the_passes_share_one_set_of_fake_quantized_weights_equal_to_each_weights_own():
    g = torch.Generator().manual_seed(0)
    t = {"a.weight": torch.randn(64, 96, generator=g).to(torch.bfloat16),
         "b.weight": (torch.randn(32, 64, generator=g) * 1e-3).to(torch.bfloat16)}
    kinds = {"a": "W8A8", "b": "W8A8_DYNAMIC"}
    weights = FakeQuantWeights(t)
    calib = CalibLinears(t, kinds, weights)
    x = torch.randn(5, 96, generator=g).to(torch.bfloat16)
    calib("a", x)
    deployed = DeployedLinears(t, kinds, {"a": (torch.tensor(0.05, dtype=torch.bfloat16),
                                                torch.tensor(0.0, dtype=torch.bfloat16))}, weights)
    assert deployed.weight is calib.weight
    assert deployed.weight("a", torch.bfloat16) is calib.weight("a", torch.bfloat16)   # made once
    other = DeployedLinears(dict(t), kinds, {})                                     # other tensors: its own
    assert other.weight is not weights
    for name in t:
        for md in (torch.bfloat16, torch.float16, torch.float32):
            q, ws, _ = quantize_weight_per_channel(t[name].to(md), name)
            own = FakeQuantWeights({name: t[name].to(md)})(name[:-len(".weight")], md)
            ref = q.to(md) * ws.to(md)
            assert own.dtype == md and torch.equal(own.view(torch.uint8), ref.view(torch.uint8))
