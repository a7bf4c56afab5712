"""Real clients on CPU, against torch.optim.AdamW on an identical copy (fp32, <= 1e-5, 30 steps,
every placement): transformers.Trainer with its default clipping (max_grad_norm=1.0) and gradient
accumulation; an accelerate loop with `clip_grad_norm_`, `save_state`/`load_state` (safetensors)
and an exact resume. Tiny models built from configs: nothing is downloaded."""
import copy

import pytest
import torch

import dos

transformers = pytest.importorskip("transformers")
accelerate = pytest.importorskip("accelerate")

STEPS = 30
PLACEMENTS = [
    dict(placement="cpu"),
    dict(placement="interleaved", stride=1),
    dict(placement="interleaved", stride=2),
    dict(placement="static", gpu_fraction=0.5),
    dict(placement="gpu"),
]
IDS = [",".join(f"{k}={v}" for k, v in p.items()) for p in PLACEMENTS]
HP = dict(lr=2e-3, weight_decay=0.01)
VOCAB = 64


def tiny(kind="llama", seed=0):
    torch.manual_seed(seed)
    if kind == "llama":
        cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                                       num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                       max_position_embeddings=32, tie_word_embeddings=False)
        return transformers.LlamaForCausalLM(cfg)
    cfg = transformers.GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=32)
    return transformers.GPT2LMHeadModel(cfg)  # tied embeddings


def data(n=64, seq=16):
    g = torch.Generator().manual_seed(0)
    start = torch.randint(0, VOCAB, (n, 1), generator=g)
    inc = torch.randint(1, 4, (n, 1), generator=g)
    ids = (start + inc * torch.arange(seq)) % VOCAB
    return [{"input_ids": x, "labels": x.clone()} for x in ids]


def max_diff(m1, m2) -> float:
    return max((p.float() - q.float()).abs().max().item() for p, q in zip(m1.parameters(), m2.parameters()))


def trainer_run(model, opt, tmp_path):
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path), per_device_train_batch_size=4, gradient_accumulation_steps=2,
        max_steps=STEPS, learning_rate=HP["lr"], lr_scheduler_type="constant", report_to=[],
        save_strategy="no", logging_strategy="no", use_cpu=True, dataloader_num_workers=0,
        disable_tqdm=True, seed=0)  # max_grad_norm=1.0: Trainer's default clipping
    trainer = transformers.Trainer(model=model, args=args, train_dataset=data(), optimizers=(opt, None))
    trainer.train()
    return trainer


@pytest.mark.parametrize("placement", PLACEMENTS, ids=IDS)
@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_trainer_default_clipping_and_accumulation(placement, kind, tmp_path):
    a = tiny(kind)
    b = copy.deepcopy(a)
    opt = dos.DeepOptimizerStates(a.parameters(), subgroup_numel=4000, **HP, **placement)
    trainer_run(a, opt, tmp_path / "dos")
    trainer_run(b, torch.optim.AdamW(b.parameters(), **HP), tmp_path / "torch")
    assert max_diff(a, b) <= 1e-5
    if opt.plan.cpu_order:  # Trainer's clipping changed gradients the CPU lane had received
        assert opt.describe()["clients"]["resent_subgroups"] > 0


SAVE_AT = 15


def accelerate_run(model, make_opt, tmp_path, save=False, load=False):
    from accelerate import Accelerator

    acc = Accelerator(cpu=True)
    opt = make_opt(model)
    loader = torch.utils.data.DataLoader(data(), batch_size=4, shuffle=False)
    model, opt, loader = acc.prepare(model, opt, loader)
    batches = [b for _ in range(2) for b in loader][:STEPS]
    start = 0
    if load:
        acc.load_state(str(tmp_path))  # weights loaded in place into the model dos optimizes
        start = SAVE_AT
    for step in range(start, STEPS):
        loss = model(**batches[step]).loss
        acc.backward(loss)
        acc.clip_grad_norm_(model.parameters(), 0.5)
        opt.step()
        opt.zero_grad()
        if save and step + 1 == SAVE_AT:
            acc.save_state(str(tmp_path))  # safetensors model, torch.save optimizer
    return acc.unwrap_model(model)


@pytest.mark.parametrize("placement", PLACEMENTS, ids=IDS)
def test_accelerate_clip_save_state_load_state_resume(placement, tmp_path):
    import safetensors.torch

    make_dos = lambda m: dos.DeepOptimizerStates(m.parameters(), subgroup_numel=4000, **HP, **placement)
    a = accelerate_run(tiny(), make_dos, tmp_path, save=True)
    b = accelerate_run(tiny(), lambda m: torch.optim.AdamW(m.parameters(), **HP), tmp_path / "t")
    assert max_diff(a, b) <= 1e-5
    saved = safetensors.torch.load_file(str(tmp_path / "model.safetensors"))
    assert len(saved) == len(tiny().state_dict())  # every tensor saved (none looked tied)
    c = accelerate_run(tiny(seed=1), make_dos, tmp_path, load=True)
    assert max_diff(a, c) == 0.0  # exact resume
