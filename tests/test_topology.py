"""Topology: the facts a plan's parallelism has over a world, asked without a process group
(the groups themselves are made and checked by the data- and tensor-parallel tests)."""

import pytest

from fxstar.errors import PlanError
from fxstar.plan import Plan
from fxstar.topology import Topology


def test_one_process_is_neither_tensor_nor_data_parallel():
    topology = Topology(Plan(device_memory="auto"))
    assert topology.world == 1
    assert topology.tp_size == 1 and not topology.tensor_parallel
    assert topology.data_parallel_size == 1 and topology.load_unit == 1
    assert topology.groups() == {} and topology.whole_group is None
    topology.release()  # nothing made: harmless


def test_data_parallel_takes_the_ranks_tensor_parallel_leaves():
    chunked = {"device_memory": "auto"}
    assert Topology(Plan(**chunked), world=4).data_parallel_size == 4
    tp2 = Topology(Plan(**chunked, tensor_parallel={"size": 2}), world=4)
    assert (tp2.tp_size, tp2.data_parallel_size, tp2.mesh.tp_groups()) == (2, 2, [[0, 1], [2, 3]])
    assert Topology(Plan(**chunked, tensor_parallel={"size": 4}), world=4).data_parallel_size == 1
    assert Topology(Plan(**chunked, data_parallel=False), world=4).data_parallel_size == 1
    with pytest.raises(PlanError, match="does not divide the world of 6"):
        _ = Topology(Plan(**chunked, tensor_parallel={"size": 4}), world=6).data_parallel_size


def test_data_parallel_without_chunks_is_refused_by_name():
    assert not Topology(Plan()).uses_chunks
    assert Topology(Plan(precision="bf16")).uses_chunks
    with pytest.raises(PlanError, match="data_parallel=False"):
        _ = Topology(Plan(), world=2).data_parallel_size


def test_sharded_payloads_follow_the_optimizer_and_refuse_sgd_by_name():
    assert Topology(Plan()).sharded_payloads
    assert not Topology(Plan(optimizer={"type": "sgd"})).sharded_payloads
    assert not Topology(Plan(data_parallel_shard="optimizer")).sharded_payloads
    with pytest.raises(PlanError, match="data_parallel_shard='params' with optimizer.type"):
        _ = Topology(Plan(data_parallel_shard="params", optimizer={"type": "sgd"})).sharded_payloads


def test_a_load_brings_a_whole_group_only_with_sharded_payloads():
    plan = Plan(device_memory="auto")
    assert Topology(plan, world=4).load_unit == 4
    assert Topology(plan.replace(mem_saving_comm=True), world=4).load_unit == 1
    assert Topology(plan.replace(data_parallel_shard="optimizer"), world=4).load_unit == 1
    assert Topology(plan, world=1).load_unit == 1
