"""The pipeline schedule of a virtual replica whose inner steps accumulate batches (a stretched round), with two
stages on two real runtimes over loopback: its steps take the full model's gradient of all their batches, and a
stage never holds more than `BATCHES_IN_FLIGHT` batches of microbatches' activations however many a step has."""

from __future__ import annotations

import threading

import pytest
import torch
from test_pipeline import CPU, data, reference, run_config

from hetero_node.client.roles.pipeline_schedule import PipelineSchedule
from hetero_node.client.roles.pipeline_stage import PipelineStage
from hetero_node.client.roles.stage_link import Expectation, StageInbox, StageSender, microbatch_sizes, wire
from hetero_node.client.swarm.runtime import PeerRuntime
from hetero_node.models.stages import BATCHES_IN_FLIGHT
from hetero_node.protocol.keys import stage_handler_name
from hetero_node.protocol.run_config import PipelineConfig

BATCH, SEQ, M = 6, 32, 3
ACCUMULATION, STEPS = 3, 2


def schedule(runtime: PeerRuntime, stage: PipelineStage, run_id: str, index: int, peer: str) -> PipelineSchedule:
    """Stage `index` of virtual replica 0 in round 0, its handler registered, its neighbour `peer`."""
    sizes = microbatch_sizes(BATCH, M)
    inbox = StageInbox(stage.fmt, 8, sizes, SEQ, BATCH)
    neighbours = {1 - index: peer}
    inbox.expect_round(Expectation(0, index, 0, previous=neighbours.get(0), next=neighbours.get(1)))
    handler = stage_handler_name(run_id)
    runtime.run(runtime.p2p.add_protobuf_handler(handler, inbox.handle, wire.StagePiece, stream_input=True))
    sender = StageSender(runtime, run_id)
    return PipelineSchedule(runtime, stage, inbox, sender, 0, index, 2, sizes, SEQ, 30.0, lambda: False, neighbours)


@pytest.mark.multipeer
def test_an_accumulating_step_takes_the_gradient_of_all_its_batches_with_two_batches_in_flight() -> None:
    pipeline = PipelineConfig(activation_compression="none", boundary_wire="fp32", microbatches=M)
    run = run_config(2, batch=BATCH, inner_steps=STEPS, pipeline=pipeline)
    stages = [PipelineStage(run, s, CPU) for s in range(2)]
    first = stages[0].forward

    held = []  # activations stage 0 holds after each forward it sends

    def forward(*args, **kwargs):
        message = first(*args, **kwargs)
        held.append(len(stages[0]._pending))
        return message

    stages[0].forward = forward
    gradients: dict[int, dict[str, torch.Tensor]] = {}  # each stage's accumulated gradient at its first step
    for index, stage in enumerate(stages):
        step = stage.optimizer_step

        def observed(index=index, stage=stage, step=step) -> None:
            if index not in gradients:
                gradients[index] = {n: p.grad.clone() for n, p in stage.module.named_parameters()}
            step()

        stage.optimizer_step = observed
    runtimes: list[PeerRuntime] = []
    try:
        runtimes.append(PeerRuntime([]))
        runtimes.append(PeerRuntime(runtimes[0].visible_maddrs))
        ids = [str(r.peer_id) for r in runtimes]
        driver, server = (schedule(runtimes[s], stages[s], run.run_id, s, ids[1 - s]) for s in range(2))
        served: list[tuple[int, list[float]]] = []
        worker = threading.Thread(target=lambda: served.append(server.serve(0)))
        worker.start()
        steps = driver.drive(0, lambda k: data(BATCH, seed=k), lambda s: s < STEPS, ACCUMULATION)
        worker.join(60)
    finally:
        for runtime in reversed(runtimes):
            runtime.shutdown()
    assert steps == STEPS and served and served[0][0] == STEPS
    assert driver.batches == server.batches == STEPS * ACCUMULATION
    assert len(held) == STEPS * ACCUMULATION * M and max(held) == BATCHES_IN_FLIGHT * M < ACCUMULATION * M
    x, y = (torch.cat(parts) for parts in zip(*(data(BATCH, seed=k) for k in range(ACCUMULATION)), strict=True))
    model, _, loss = reference(run, x, y)  # step 0: batches 0, 1 and 2, from the same initial weights
    assert abs(served[0][1][0] - loss) < 1e-5
    weights = dict(model.named_parameters())
    assert set(gradients[0]) | set(gradients[1]) == set(weights)
    for stage_gradients in gradients.values():
        for name, grad in stage_gradients.items():
            torch.testing.assert_close(grad, weights[name].grad, rtol=0, atol=1e-5, msg=name)
