"""The tables of op kinds and tiers (``ir.kinds``, ``ir.tiers``) are complete, agree with each other, with the
grammar and with the runtime's handler tables, and name fields that exist where they point."""

import dataclasses

import pytest

import lazytrain.ir as ir
from lazytrain.compiler.cost import CostModel
from lazytrain.compiler.hardware import HardwareProfile
from lazytrain.compiler.profiles import get_profile
from lazytrain.compiler.synthetic import chain
from lazytrain.ir import Op, OpKind, Resource, TensorId, TensorKind, Tier
from lazytrain.ir.kinds import COPY_KINDS, KINDS
from lazytrain.ir.semantics import EFFECTS
from lazytrain.ir.tiers import COPIES, TIERS, copy, path
from lazytrain.ir.verify import MemoryReport
from lazytrain.runtime import handlers, interpreter
from lazytrain.runtime.context import Run


def test_every_op_kind_has_a_row_effects_and_a_runtime_handler():
    assert set(KINDS) == set(OpKind)
    assert set(EFFECTS) == set(OpKind)
    assert set(interpreter.HANDLERS) == set(OpKind)
    for kind, spec in KINDS.items():
        assert spec.kind is kind and spec.effects is EFFECTS[kind]


def test_every_grammar_line_is_in_the_package_docstring():
    for spec in KINDS.values():
        assert spec.grammar.startswith(spec.kind.value)
        assert spec.grammar in ir.__doc__, spec.kind


def test_copies_are_the_kinds_without_a_resource_of_their_own():
    assert COPY_KINDS == {OpKind.OFFLOAD, OpKind.RELOAD}
    assert {c.kind for c in COPIES.values()} == COPY_KINDS


def test_every_tier_names_fields_that_exist():
    report = {f.name for f in dataclasses.fields(MemoryReport)}
    profile = {f.name for f in dataclasses.fields(HardwareProfile)}
    run = {f.name for f in dataclasses.fields(Run)}
    assert set(TIERS) == set(Tier)
    for tier, spec in TIERS.items():
        assert spec.tier is tier and spec.peak in report and spec.store in run
        assert spec.budget.endswith("_bytes")
        if spec.via is not None:
            assert spec.into_gbps in profile and spec.out_gbps in profile
            assert Resource.NONE not in (spec.into_resource, spec.out_resource)


def test_the_runtime_copies_and_frees_every_tier():
    assert set(handlers.COPIES) == set(COPIES)
    assert set(handlers.FREES) == set(Tier)


def test_moves_between_the_gpu_and_nvme_go_through_the_host():
    assert [(c.src, c.dst, c.resource) for c in path(Tier.GPU, Tier.NVME)] == [
        (Tier.GPU, Tier.HOST, Resource.D2H), (Tier.HOST, Tier.NVME, Resource.NVME)]
    assert [(c.kind, c.resource) for c in path(Tier.NVME, Tier.GPU)] == [
        (OpKind.RELOAD, Resource.NVME), (OpKind.RELOAD, Resource.H2D)]
    with pytest.raises(KeyError):
        copy(Tier.GPU, Tier.NVME)


def test_a_copy_is_priced_at_its_tiers_bandwidth():
    hw = get_profile("h200")
    cost = CostModel(chain(2, hidden=64, seq_len=16, layer_params=1000, vocab=100), hw, 1)
    n = 3 << 30
    assert cost.copy_s(copy(Tier.HOST, Tier.NVME), n) == hw.nvme_seconds(n, True)
    assert cost.copy_s(copy(Tier.NVME, Tier.HOST), n) == hw.nvme_seconds(n, False)
    assert cost.d2h_s(n) == hw.d2h_seconds(n) and cost.h2d_s(n) == hw.h2d_seconds(n)


def test_a_copy_in_the_wrong_direction_is_refused_at_run_time():
    op = Op(id=0, kind=OpKind.OFFLOAD, block=0, mb=0, tensor=TensorId(kind=TensorKind.ACT, index=1, mb=0),
            src=Tier.HOST, dst=Tier.GPU)
    with pytest.raises(ValueError, match="offload .* is not a move this runtime knows"):
        handlers.copy(None, op)
