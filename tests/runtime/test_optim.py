"""HybridAdam through the engine against torch's AdamW on the eager model; precision, loss
scaling, clipping and accumulation."""

import pytest
import torch
from conftest import activation_budget, call, example, hf_llama, tiny_gpt, tokens

from fxstar import _C
from fxstar.engine import compile
from fxstar.plan import Plan
from fxstar.runtime.loss_scale import LossScaler
from fxstar.runtime.optim import HybridAdam
from fxstar.train import TrainConfig, train

OPT = {"type": "adamw", "lr": 1e-3, "weight_decay": 0.1}


def gpt_without_biases(seed: int = 0):
    """nanoGPT's bias=False form. With biases, the attention key bias has an exactly-zero true
    gradient, so what autograd gives it is rounding noise, which Adam scales up to full steps
    of +-lr: any two Adam implementations that differ by an ulp (torch's own sqrt is not
    correctly rounded here) drift apart there, which says nothing about the optimizer."""
    from fxstar.models.gpt import GPT, GPTConfig

    torch.manual_seed(seed)
    return GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32,
                         dropout=0.1, bias=False))  # fmt: skip


FACTORIES = {"gpt": gpt_without_biases, "llama": hf_llama}


def tight(kind) -> int:
    return activation_budget(FACTORIES[kind], 0.4, **example(kind, *tokens()))


def roomy(kind) -> int:
    """A budget whose margin holds some chunks' optimizer state, not all of it."""
    return activation_budget(FACTORIES[kind], 2.0, **example(kind, *tokens()))


def train_steps(engine, steps: int) -> list[torch.Tensor]:
    """`steps` engine steps on the seeded batches; the losses."""
    losses = []
    for step in range(steps):
        ids, targets = tokens(seed=step)
        torch.manual_seed(step)
        loss = engine(ids, targets)
        loss.backward()
        engine.step()
        losses.append(loss.detach())
    return losses


def assert_split_between_tiers(engine) -> None:
    """HybridAdam kept some chunks on the compute tier, and left some on the host."""
    kept = engine.optimizer.device_chunks
    trainable = [c for c in engine.chunks.chunks if c.grad is not None]
    assert 0 < len(kept) < len(trainable), (kept, len(trainable))
    assert all(engine.chunks.chunks[i].kept for i in kept)
    assert "kept on the compute tier with their optimizer state" in engine.report()


def reference_optimizer(model, plan):
    decay = [p for n, p in model.named_parameters() if plan.optimizer.decays(n)]
    rest = [p for n, p in model.named_parameters() if not plan.optimizer.decays(n)]
    groups = [{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=OPT["lr"])


def assert_params_match(eager, engine):
    for (name, p), (_, q) in zip(eager.named_parameters(), engine.named_parameters(), strict=True):
        torch.testing.assert_close(q, p, rtol=1e-5, atol=1e-6, msg=name)
        err = float((q.detach().double() - p.detach().double()).norm() / p.detach().double().norm())
        assert err <= 1e-6, (name, err, float(p.double().norm()))


@pytest.mark.parametrize("kernel", ["host-only", "cpu", "torch"])
@pytest.mark.parametrize("kind", FACTORIES)
def test_fp32_twenty_steps_match_torch_adamw(kind, kernel):
    """host-only: every chunk on the host; cpu/torch: some kept on the compute tier and
    updated there by the C++ kernel (what a CPU compute tier uses) or torch's fused Adam (what
    an accelerator uses, run here on the CPU)."""
    hybrid = kernel != "host-only"
    eager, model = FACTORIES[kind](), FACTORIES[kind]()
    budget = roomy(kind) if hybrid else tight(kind)
    plan = Plan(device_memory=budget, optimizer=OPT, hybrid_adam=hybrid)
    engine = compile(model, plan, **example(kind, *tokens()))
    assert isinstance(engine.optimizer, HybridAdam)
    if hybrid:
        engine.optimizer.device_kernel = kernel
    engine.chunks.checking = True  # every access: resident chunks within their share
    reference = reference_optimizer(eager, plan)
    for step in range(20):
        ids, targets = tokens(seed=step)
        torch.manual_seed(step)
        call(kind, eager, ids, targets).backward()
        reference.step()
        reference.zero_grad()
        torch.manual_seed(step)
        call(kind, engine, ids, targets).backward()
        assert engine.step()
    assert_params_match(eager, engine)
    if hybrid:
        assert_split_between_tiers(engine)
    else:
        assert engine.optimizer.device_chunks == []
    eager.load_state_dict(engine.state_dict())  # the kept chunks' values included
    assert_params_match(eager, engine)


@pytest.mark.parametrize("budget", [tight, roomy], ids=["host", "hybrid"])
def test_clipping_matches_clip_grad_norm(budget):
    eager, model = gpt_without_biases(), gpt_without_biases()
    plan = Plan(device_memory=budget("gpt"), optimizer={**OPT, "clip_grad_norm": 0.05})
    engine = compile(model, plan, **example("gpt", *tokens()))
    reference = reference_optimizer(eager, plan)
    for step in range(5):
        ids, targets = tokens(seed=step)
        torch.manual_seed(step)
        eager(ids, targets).backward()
        norm = torch.nn.utils.clip_grad_norm_(eager.parameters(), 0.05)
        reference.step()
        reference.zero_grad()
        torch.manual_seed(step)
        engine(ids, targets).backward()
        engine.step()
        assert engine.optimizer.last_grad_norm == pytest.approx(float(norm), rel=1e-5)
        assert float(norm) > 0.05  # the clip really acted
    assert_params_match(eager, engine)


@pytest.mark.parametrize("overlap", ["off", "on"])
def test_accumulation_over_four_micro_batches(overlap):
    """Also with gradient copies beside backward (a worker thread here): the second
    micro-batch's gradients wait for the first's copies before adding to them."""
    eager, model = gpt_without_biases(), gpt_without_biases()
    plan = Plan(device_memory=tight("gpt"), optimizer={**OPT, "accumulation_steps": 4},
                overlap_grad_copies=overlap)  # fmt: skip
    engine = compile(model, plan, **example("gpt", *tokens()))
    reference = reference_optimizer(eager, plan)
    for step in range(2):
        for micro in range(4):
            ids, targets = tokens(seed=10 * step + micro)
            torch.manual_seed(micro)
            (eager(ids, targets) / 4).backward()
            torch.manual_seed(micro)
            (engine(ids, targets) / 4).backward()
            assert engine.step() == (micro == 3)
        reference.step()
        reference.zero_grad()
    assert_params_match(eager, engine)
    overlap_share = engine.chunks.grad_copy_overlap()
    if overlap == "on":
        assert 0.0 <= overlap_share <= 1.0 and engine.chunks.stats.grad_copy_seconds > 0
        assert "gradient copies:" in engine.report() and "hidden behind backward" in engine.report()
    else:
        assert overlap_share is None


def test_lr_scheduler_drives_the_groups():
    engine = compile(tiny_gpt(), Plan(precision="bf16", optimizer=OPT), **example("gpt", *tokens()))
    scheduler = torch.optim.lr_scheduler.StepLR(engine.optimizer, step_size=1, gamma=0.5)
    ids, targets = tokens()
    engine(ids, targets).backward()
    engine.step()
    scheduler.step()
    assert [g["lr"] for g in engine.optimizer.param_groups] == [OPT["lr"] / 2] * 2


def demo_loss(precision: str) -> float:
    """The demo job (the reference GPT on the shipped text), small, for 50 steps: the mean
    loss of the last ten steps."""
    config = TrainConfig(steps=50, batch_size=4, seq_len=32, n_layer=2, n_head=2, n_embd=64,
                         log_every=0)  # fmt: skip
    result = train(config, Plan(precision=precision, optimizer={"lr": 3e-3}), progress=False)
    return sum(result.losses[-10:]) / 10


def test_bf16_chunks_kept_on_the_compute_tier_train_like_the_host_ones():
    """The device half under bf16: fp32 masters and moments beside the kept chunks, the bf16
    compute copy rounded from them; the same run with everything on the host agrees."""
    budget = activation_budget(gpt_without_biases, 2.0, **example("gpt", *tokens()))
    runs = {}
    for kernel in ("host-only", "cpu", "torch"):
        plan = Plan(precision="bf16", device_memory=budget, optimizer=OPT,
                    hybrid_adam=kernel != "host-only")  # fmt: skip
        engine = compile(gpt_without_biases(), plan, **example("gpt", *tokens()))
        engine.optimizer.device_kernel = kernel
        engine.chunks.checking = True
        runs[kernel] = engine, [float(loss) for loss in train_steps(engine, 8)]
    host, host_losses = runs["host-only"]
    for kernel in ("cpu", "torch"):
        engine, losses = runs[kernel]
        assert_split_between_tiers(engine)
        assert losses == pytest.approx(host_losses, rel=1e-3)
        for p, q in zip(engine.parameters(), host.parameters(), strict=True):
            assert p.dtype == torch.float32
            torch.testing.assert_close(p, q, rtol=1e-3, atol=1e-4)
        kept = engine.chunks.chunks[engine.optimizer.device_chunks[0]]
        compute_copy = engine.chunks.chunk_view(kept)[: kept.used]
        assert torch.equal(compute_copy, kept.master[: kept.used].to(torch.bfloat16))


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_kept_chunks_never_have_host_moments(precision):
    """The device half is chosen at the first step, before its update: the moments the step
    makes on the host (8 bytes per parameter a chunk reaches) are exactly the other chunks'."""
    plan = Plan(precision=precision, device_memory=roomy("gpt"), optimizer=OPT, hybrid_adam=True)
    engine = compile(gpt_without_biases(), plan, **example("gpt", *tokens()))
    ids, targets = tokens(seed=0)
    engine(ids, targets).backward()
    assert isinstance(engine.optimizer, HybridAdam)  # made at first use, no moments yet
    before = _C.host_bytes_in_use()
    assert engine.step()  # the first training step chooses the device half, then updates
    kept = [engine.chunks.chunks[i] for i in engine.optimizer.device_chunks]
    assert kept and all(chunk.kept for chunk in kept)
    on_host = [c for c in engine.chunks.chunks if c.grad is not None and not c.kept]
    assert on_host and _C.host_bytes_in_use() - before == sum(8 * c.used for c in on_host)
    # the host homes they left (payload, master, gradient buffer) give their pages back
    released = engine.chunks.reservations.released_bytes
    assert released > 0 and f"{released:,} bytes of their host homes given back" in engine.report()


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_low_precision_loss_within_two_percent_of_fp32(precision):
    assert demo_loss(precision) == pytest.approx(demo_loss("fp32"), rel=0.02)


def test_fp16_overflow_skips_exactly_that_step_and_halves_the_scale():
    ids, targets = tokens()
    plan = Plan(precision="fp16", loss_scale={"initial_scale_power": 8, "hysteresis": 1})
    engine = compile(tiny_gpt(dropout=0.0), plan, (ids, targets))
    engine(ids, targets).backward()
    assert engine.step()
    assert engine.scaler.scale == 256.0
    before = [p.detach().clone() for p in engine.parameters()]
    engine(ids, targets).backward()
    engine.chunks.chunks[0].grad[3] = float("inf")  # a planted overflow
    assert not engine.step()
    assert engine.scaler.scale == 128.0 and engine.optimizer.skipped_steps == 1
    assert all(torch.equal(a, b) for a, b in zip(before, engine.parameters(), strict=True))
    engine.backward(engine(ids, targets))
    assert engine.step()  # and the next step runs again
    assert "fp16 loss scale 128; 1 steps skipped for overflow" in engine.report()
    assert not all(torch.equal(a, b) for a, b in zip(before, engine.parameters(), strict=True))


def test_dynamic_loss_scaler():
    scaler = LossScaler(scale=8.0, window=2, hysteresis=2, overflows_left=2, min_scale=2.0)
    scaler.update(overflow=False)
    scaler.update(overflow=False)
    assert scaler.scale == 16.0  # a clean window doubles
    scaler.update(overflow=True)
    assert scaler.scale == 16.0  # hysteresis: the first overflow is tolerated
    scaler.update(overflow=True)
    assert scaler.scale == 8.0
    for _ in range(6):
        scaler.update(overflow=True)
    assert scaler.scale == 2.0 and scaler.skipped_steps == 8  # never below the minimum
    fixed = LossScaler(scale=4.0, dynamic=False)
    fixed.update(overflow=True)
    assert fixed.scale == 4.0


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_gradient_copies_beside_backward_change_nothing(precision):
    """overlap_grad_copies only moves when the copies run: the same run bitwise."""
    results = []
    for overlap in ("off", "on"):
        plan = Plan(precision=precision, device_memory=tight("gpt"), optimizer=OPT,
                    overlap_grad_copies=overlap, checkpoint="blocks")  # fmt: skip
        engine = compile(gpt_without_biases(), plan, **example("gpt", *tokens()))
        losses = train_steps(engine, 4)
        results.append((losses, [p.detach().clone() for p in engine.parameters()]))
    (losses, params), (other_losses, other_params) = results
    assert all(torch.equal(a, b) for a, b in zip(losses, other_losses, strict=True))
    assert all(torch.equal(a, b) for a, b in zip(params, other_params, strict=True))


def test_a_chunk_that_cannot_be_kept_stays_on_the_host_and_gives_its_room_back(monkeypatch):
    plan = Plan(device_memory=roomy("gpt"), optimizer=OPT)
    engine = compile(gpt_without_biases(), plan, **example("gpt", *tokens()))
    manager = engine.chunks

    def fragmented(chunk_id, **options):
        raise MemoryError("the arena is fragmented")

    monkeypatch.setattr(manager.step_chunks, "keep", fragmented)
    engine(*tokens()).backward()
    assert engine.step()
    assert engine.optimizer.device_chunks == [] and manager.reserved == []
    assert manager.arena.stats()["in_use"] <= manager.budget
    engine(*tokens()).backward()  # and training goes on, all on the host
    assert engine.step()


class DetachedReuse(torch.nn.Module):
    """A weight read twice: by its own linear, and detached, as a constant, by another. Its
    gradient arrives (and, kept under bf16, takes its payload's room) before backward reads
    the detached copy that the second linear saved."""

    def __init__(self, width: int = 32, vocab: int = 64):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, width)
        self.first, self.second = torch.nn.Linear(width, width), torch.nn.Linear(width, width)
        self.head = torch.nn.Linear(width, vocab)

    def forward(self, ids, targets):
        h = torch.tanh(self.embed(ids))
        constant = torch.nn.functional.linear(h, self.second.weight.detach())
        out = self.head(torch.tanh(self.second(self.first(h))) * constant)
        return torch.nn.functional.cross_entropy(out.flatten(0, 1), targets.flatten())


def detached_reuse() -> DetachedReuse:
    torch.manual_seed(0)
    return DetachedReuse()


def llama_defaults() -> torch.nn.Module:
    """transformers' Llama defaults (use_cache=True, untied head) but for the sizes."""
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
        bos_token_id=0, eos_token_id=0, pad_token_id=0,
    )  # fmt: skip
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config)


ROOM_MODELS = {"gpt": tiny_gpt, "llama": llama_defaults}  # the GPT: biases, dropout 0.1


def _bf16_runs(factory, drive, kind: str = "gpt") -> dict:
    """`drive(engine)` on bf16 chunks, everything kept on the compute tier (the C++ kernel,
    as on the host) and everything on the host: their losses and parameters."""
    runs = {}
    for keep in (True, False):
        plan = Plan(precision="bf16", device_memory="1GiB", optimizer=OPT, hybrid_adam=keep,
                    chunk_size=4096)  # fmt: skip
        engine = compile(factory(), plan, **example(kind, *tokens()))
        engine.chunks.checking = True
        losses = drive(engine)
        runs[keep] = engine, losses, [p.detach().clone() for p in engine.parameters()]
    return runs


def _assert_bitwise(runs: dict) -> None:
    (kept, kept_losses, kept_params), (_, host_losses, host_params) = runs[True], runs[False]
    trainable = [c for c in kept.chunks.chunks if c.grad is not None]
    assert sorted(kept.optimizer.device_chunks) == [c.id for c in trainable]
    assert kept_losses == host_losses
    assert all(torch.equal(p, q) for p, q in zip(kept_params, host_params, strict=True))


@pytest.mark.parametrize("kind", ROOM_MODELS)
def test_kept_bf16_chunks_take_their_gradient_in_the_payload_room(kind):
    """14 bytes per kept parameter, as on the host: the gradient has no buffer of its own
    but the compute payload's room, the moments and the master beside it; and the training
    is bitwise the host chunks' (the same kernel, the same dropout draws)."""

    def drive(engine) -> list[float]:
        losses = []
        for step in range(4):
            torch.manual_seed(step)
            loss = call(kind, engine, *tokens(seed=step))
            loss.backward()
            engine.step()
            losses.append(loss.item())
        return losses

    runs = _bf16_runs(ROOM_MODELS[kind], drive, kind)
    _assert_bitwise(runs)
    engine = runs[True][0]
    manager, n = engine.chunks, engine.chunks.layout.chunk_size
    for chunk_id in engine.optimizer.device_chunks:
        chunk = manager.chunks[chunk_id]
        assert chunk.grad.data_ptr() == manager.chunk_view(chunk).data_ptr()
    rounded = manager.arena.allocator.round_up
    per_chunk = rounded(8 * n) + rounded(4 * n)  # moments, master: no gradient block
    assert manager.reserved_bytes() == len(engine.optimizer.device_chunks) * per_chunk
    assert "the gradients in the payloads' room" in engine.report()


def test_kept_payload_room_gives_the_parameters_to_reads_after_their_gradient():
    """Reads of a parameter whose gradient took its room: a detached copy saved for
    backward and read after the gradient arrived; a second forward and backward before the
    step (accumulation by hand); a forward under no_grad before the step. Each gets the
    parameter's values: bitwise the host chunks' run."""

    def drive(engine):
        losses = []
        for step in range(3):
            for micro in range(2):
                ids, targets = tokens(seed=2 * step + micro)
                loss = engine(ids, targets)
                loss.backward()
                losses.append(float(loss))
            with torch.no_grad():
                losses.append(float(engine(*tokens(seed=99))))
            engine.step()
            engine.zero_grad()
        return losses

    _assert_bitwise(_bf16_runs(detached_reuse, drive))


# -- kept chunks and a later, larger input ----------------------------------------------------


def gpt_of_32_positions(seed: int = 0):
    from fxstar.models.gpt import GPT, GPTConfig

    torch.manual_seed(seed)
    return GPT(GPTConfig(vocab_size=64, block_size=32, n_layer=2, n_head=2, n_embd=32,
                         dropout=0.1, bias=False))  # fmt: skip


def test_kept_chunks_a_longer_batch_has_no_room_for_go_back_and_train_like_adamw():
    """Kept at the first step (8 tokens: a wide margin); the 24-token capture's plan leaves
    room for fewer, so the least used go back to the host tier with their moments before it
    runs, and stay there. In both shapes, alternately, every step's loss, gradients and
    updated parameters are eager's with torch's AdamW (bitwise before the first update,
    within the kernels' rounding after)."""
    budget = activation_budget(gpt_of_32_positions, 0.6, example_inputs=tokens(seq=24))
    eager, model = gpt_of_32_positions(), gpt_of_32_positions()
    plan = Plan(device_memory=budget, optimizer=OPT)
    engine = compile(model, plan, example_inputs=tokens(seq=8))
    engine.chunks.checking = True
    reference = reference_optimizer(eager, plan)
    kept = []
    for step, seq in enumerate([8, 24, 8, 24, 8]):
        ids, targets = tokens(seed=step, seq=seq)
        torch.manual_seed(step)
        expected = eager(ids, targets)
        expected.backward()
        torch.manual_seed(step)
        loss = engine(ids, targets)
        loss.backward()
        exact = {"rtol": 0, "atol": 0} if step == 0 else {"rtol": 1e-5, "atol": 1e-7}
        torch.testing.assert_close(loss, expected, **exact)
        for (name, p), (_, q) in zip(eager.named_parameters(), engine.named_parameters()):
            torch.testing.assert_close(q.grad, p.grad, **exact, msg=f"{step} {name}")
        reference.step()
        reference.zero_grad()
        engine.step()
        kept.append(list(engine.optimizer.device_chunks))
        assert_params_match(eager, engine)
    first, later = kept[0], kept[1]
    assert len(first) >= 2 and 0 < len(later) < len(first) and later == first[: len(later)]
    assert kept[2:] == [later] * 3  # given back for good: no churn between the shapes
    room = engine.prepare(*tokens(seq=24)).decisions.chunk_plan.kept_room()
    assert engine.chunks.kept_bytes() <= room
    assert [c.id for c in engine.chunks.chunks if c.kept] == sorted(later)
    eager.load_state_dict(engine.state_dict())  # the given-back chunks' values included
    assert_params_match(eager, engine)


def resnet(seed: int = 0):
    """transformers' ResNet (BatchNorm: running statistics as buffers) at small sizes, its
    config's defaults otherwise."""
    transformers = pytest.importorskip("transformers")
    config = transformers.ResNetConfig(embedding_size=16, hidden_sizes=[16, 32], depths=[1, 1],
                                       layer_type="basic", num_labels=5)  # fmt: skip
    torch.manual_seed(seed)
    return transformers.ResNetForImageClassification(config)


def images(seed: int, size: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"pixel_values": torch.randn(2, 3, size, size, generator=g),
            "labels": torch.randint(0, 5, (2,), generator=g)}  # fmt: skip


SIZES = [32, 48, 32, 48]  # the first step keeps chunks, the larger images have no room for them


def test_resnet_gives_its_kept_chunks_back_for_larger_images_and_trains_like_eager():
    """fp32 against eager with torch's AdamW: loss, gradients, BatchNorm's running
    statistics and the updated parameters at every step, both image sizes alternately."""
    budget = activation_budget(resnet, 0.4, example_kwargs=images(0, 48))
    eager, model = resnet(), resnet()
    plan = Plan(device_memory=budget, optimizer=OPT)
    engine = compile(model, plan, example_kwargs=images(0, SIZES[0]))
    engine.chunks.checking = True
    reference = reference_optimizer(eager, plan)
    kept = []
    for step, size in enumerate(SIZES):
        batch = images(step, size)
        expected, loss = eager(**batch).loss, engine(**batch).loss
        expected.backward()
        loss.backward()
        exact = {"rtol": 0, "atol": 0} if step == 0 else {"rtol": 1e-5, "atol": 1e-7}
        torch.testing.assert_close(loss, expected, **exact)
        for (name, p), (_, q) in zip(eager.named_parameters(), engine.named_parameters()):
            torch.testing.assert_close(q.grad, p.grad, **exact, msg=f"{step} {name}")
        reference.step()
        reference.zero_grad()
        engine.step()
        kept.append(list(engine.optimizer.device_chunks))
        assert_params_match(eager, engine)
        for (name, b), (_, c) in zip(eager.named_buffers(), engine.named_buffers()):
            torch.testing.assert_close(c, b, rtol=1e-5, atol=1e-7, msg=f"{step} {name}")
    assert kept[0] and len(kept[1]) < len(kept[0]) and kept[2:] == [kept[1]] * 2
    given = sorted(set(kept[0]) - set(kept[1]))
    assert f"kept chunks {given} went back to the host tier" in engine.report()


@pytest.mark.parametrize("disk", [False, True], ids=["host", "disk tier"])
def test_bf16_kept_chunks_given_back_train_bitwise_like_the_host_ones(disk, tmp_path):
    """bf16 (the gradient in the kept payload's room, the fp32 master beside it): an engine
    whose kept chunk goes back for the larger images steps bitwise like one that keeps
    nothing (one chunk size for both: the same layout), BatchNorm statistics included; also
    when it goes back between two forwards whose one backward reads what the first saved.
    With the disk tier the chunk given back goes to it, moments and master."""
    budget = 4 * sum(p.numel() * 4 for p in resnet().parameters())
    engines = []
    for hybrid in (True, False):
        directory = str(tmp_path / "state") if disk and hybrid else None
        plan = Plan(device_memory=budget, precision="bf16", optimizer=OPT, hybrid_adam=hybrid,
                    chunk_size=12_000, disk=directory)  # fmt: skip
        engines.append(compile(resnet(), plan, example_kwargs=images(0, 32)))
    kept, host = engines
    given = []
    for step, sizes in enumerate([(32,), (32, 48), (48,), (32,)]):
        losses = []
        for engine in engines:
            loss = sum(engine(**images(10 * step + i, size)).loss for i, size in enumerate(sizes))
            loss.backward()
            engine.step()
            losses.append(loss.detach())
        assert torch.equal(*losses), step
        given.append(list(kept.optimizer.device_chunks))
    assert given[0] and len(given[1]) < len(given[0]) and given[2:] == [given[1]] * 2
    for (name, p), (_, q) in zip(host.named_parameters(), kept.named_parameters()):
        assert torch.equal(p, q), name
    for (name, b), (_, c) in zip(host.model.named_buffers(), kept.model.named_buffers()):
        assert torch.equal(b, c), name
    moments = [s.optimizer.state_dict()["state"] for s in (host, kept)]
    assert all(torch.equal(v, moments[1][i][k]) for i, entry in moments[0].items()
               for k, v in entry.items() if torch.is_tensor(v))  # fmt: skip
    if disk:  # the chunk given back streams from the disk tier with the others
        assert set(given[0]) <= set(kept.optimizer.on_disk)
