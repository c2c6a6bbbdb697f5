"""A user's training script, not written for memfit: a transformers model built from its config (no download).

The composition tests run it plainly on a roomy cpu-sim device (``--measure-peak``: the reference
losses, parameters and peak) and under ``memfit run`` at a fraction of that peak. It prints one
JSON line: the losses, a digest of the final parameters, and the peak when measured.

Options reproduce what real training does to the operator sequence: ``--changes`` adds a
data-dependent extra block (on about one batch in ten), a skipped optimizer step every 7th
iteration (as a loss scaler does on overflow) and a validation pass every 10; ``--lengths``
cycles the sequence length through several values; ``--log-between`` logs the loss (``loss.item()``)
between ``backward()`` and the optimizer step, as most scripts do; ``--accumulate N`` accumulates the
gradients of N micro-batches before each step (the loss divided by N, as people write it);
``--grad-scaler`` steps through a ``torch.amp.GradScaler``, whose every 7th step overflows (an
infinite loss scaled) and is skipped, as a loss scaler skips a step on overflow; ``--optimizers 2``
trains the embeddings and the rest with two optimizers, each under its own LR schedule, with the
gradients clipped and zeroed to zeros (``set_to_none=False``); ``--autocast bf16`` runs forward and
loss under CPU autocast; ``--compile-block`` compiles one transformer block (``torch.compile``)
inside the eager loop; ``--accelerate`` runs the loop through accelerate's ``Accelerator`` (on the CPU) without
the Trainer: the model and optimizer ``prepare``d, ``accelerator.backward(loss)``, gradients accumulated with
``accelerator.accumulate`` over ``--accumulate`` micro-batches and clipped with ``accelerator.clip_grad_norm_``.
"""

import argparse
import contextlib
import hashlib
import json

import torch

parser = argparse.ArgumentParser()
parser.add_argument("--model", choices=["gpt2", "gpt-neox", "llama", "qwen2"], default="gpt2")
parser.add_argument("--iterations", type=int, default=30)
parser.add_argument("--batch", type=int, default=8)
parser.add_argument("--lengths", default="128", help="sequence lengths, cycled through")
parser.add_argument("--changes", action="store_true")
parser.add_argument("--log-between", action="store_true")
parser.add_argument("--accumulate", type=int, default=1)
parser.add_argument("--dropout", type=float, default=0.0)
parser.add_argument("--grad-scaler", action="store_true")
parser.add_argument("--optimizers", type=int, choices=[1, 2], default=1)
parser.add_argument("--autocast", choices=["bf16"], default=None)
parser.add_argument("--compile-block", action="store_true")
parser.add_argument("--accelerate", action="store_true")
parser.add_argument("--measure-peak", action="store_true")
parser.add_argument("--hidden", type=int, default=128, help="hidden size of the qwen2 and llama models (MLP: twice it)")
args = parser.parse_args()
lengths = [int(x) for x in args.lengths.split(",")]

torch.manual_seed(0)
if args.model == "gpt2":
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(n_layer=4, n_embd=128, n_head=4, vocab_size=512, n_positions=512, attn_implementation="eager")
    model = GPT2LMHeadModel(config)
    blocks = model.transformer.h
    hidden = config.n_embd
elif args.model == "gpt-neox":
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

    config = GPTNeoXConfig(
        hidden_size=128, intermediate_size=512, num_hidden_layers=4, num_attention_heads=4, vocab_size=512,
        max_position_embeddings=512, attn_implementation="eager", hidden_dropout=args.dropout,
        attention_dropout=args.dropout,
    )  # fmt: skip
    model = GPTNeoXForCausalLM(config)
    blocks = model.gpt_neox.layers
    hidden = config.hidden_size
elif args.model == "qwen2":
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        hidden_size=args.hidden, intermediate_size=2 * args.hidden, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=512, max_position_embeddings=512, attn_implementation="eager",
        attention_dropout=args.dropout,
    )  # fmt: skip
    model = Qwen2ForCausalLM(config)
    blocks = model.model.layers
    hidden = config.hidden_size
else:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        hidden_size=args.hidden, intermediate_size=2 * args.hidden, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=512, max_position_embeddings=512, attn_implementation="sdpa",
    )  # fmt: skip
    model = LlamaForCausalLM(config)
    blocks = model.model.layers
    hidden = config.hidden_size
model.train()
extra = torch.nn.Linear(hidden, hidden)
if args.optimizers == 1:
    optimizers = [torch.optim.AdamW([*model.parameters(), *extra.parameters()], lr=1e-3)]
    schedulers = []
else:  # the embeddings with one optimizer, the rest with another, each under its own schedule
    embeddings = {id(p) for p in model.get_input_embeddings().parameters()}
    rest = [p for p in [*model.parameters(), *extra.parameters()] if id(p) not in embeddings]
    optimizers = [torch.optim.SGD(model.get_input_embeddings().parameters(), lr=1e-2, momentum=0.9),
                  torch.optim.AdamW(rest, lr=1e-3)]  # fmt: skip
    schedulers = [torch.optim.lr_scheduler.StepLR(optimizers[0], step_size=5, gamma=0.5),
                  torch.optim.lr_scheduler.LambdaLR(optimizers[1], lambda step: min(1.0, (step + 1) / 4))]  # fmt: skip
if args.compile_block:
    blocks[1].compile()
accelerator = None
if args.accelerate:
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=args.accumulate)
    model, optimizers[0] = accelerator.prepare(model, optimizers[0])
autocast = torch.autocast("cpu", dtype=torch.bfloat16) if args.autocast else contextlib.nullcontext()
branch = {"on": False}


def extra_block(module, inputs, output):
    if not branch["on"]:
        return output
    h = output[0] if isinstance(output, tuple) else output
    h = h + torch.nn.functional.gelu(extra(h))
    return (h, *output[1:]) if isinstance(output, tuple) else h


if args.changes:
    blocks[1].register_forward_hook(extra_block)

measuring = contextlib.nullcontext()
backend = None
if args.measure_peak:
    from memfit.backends.cpu_sim import CpuSimBackend

    backend = CpuSimBackend(capacity="8GiB")
    measuring = backend.activate()

scaler = torch.amp.GradScaler("cpu", init_scale=1024.0) if args.grad_scaler else None
generator = torch.Generator().manual_seed(1)
losses = []


def accelerate_step(ids):
    """accelerate's loop without the Trainer, as its docs write it: accumulate, backward, clip, step, zero_grad."""
    for micro in range(args.accumulate):
        part = ids if args.accumulate == 1 else torch.roll(ids, micro, dims=0)
        with accelerator.accumulate(model):
            loss = model(part, labels=part).loss
            accelerator.backward(loss)
            if accelerator.sync_gradients:
                accelerator.clip_grad_norm_(model.parameters(), 1.0)
            optimizers[0].step()
            optimizers[0].zero_grad()
    return loss


with measuring:
    for i in range(args.iterations):
        if accelerator is not None:
            length = lengths[i % len(lengths)]
            ids = torch.randint(0, config.vocab_size, (args.batch, length), generator=generator)
            losses.append(accelerate_step(ids).item())
            continue
        length = lengths[i % len(lengths)]
        ids = torch.randint(0, config.vocab_size, (args.batch, length), generator=generator)
        if args.changes and i and i % 10 == 0:
            with torch.no_grad():
                model(torch.randint(0, config.vocab_size, (args.batch, length), generator=generator), labels=ids)
        branch["on"] = args.changes and int(ids[0, 0]) % 10 == 0
        for micro in range(args.accumulate):
            part = ids if args.accumulate == 1 else torch.roll(ids, micro, dims=0)  # another batch per micro-step
            with autocast:
                loss = model(part, labels=part).loss / args.accumulate
            if scaler is None:
                loss.backward()
            else:  # every 7th step overflows: its gradients are not finite and the scaler skips it
                scaler.scale(loss * float("inf") if i % 7 == 6 else loss).backward()
        if args.log_between:
            print(f"step {i}: loss {loss.item():.4f}", flush=True)  # logging before the step, as people do
        if scaler is not None:
            scaler.step(optimizers[0])
            scaler.update()
        elif not (args.changes and i % 7 == 6):
            if len(optimizers) > 1:
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            for optimizer in optimizers:
                optimizer.step()
            for scheduler in schedulers:
                scheduler.step()
        for optimizer in optimizers:
            optimizer.zero_grad(set_to_none=len(optimizers) == 1)
        losses.append(loss.item())
    digest = hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in model.parameters())).hexdigest()
    peak = backend.max_memory_allocated() if backend is not None else None
# the intra-op thread count: reductions split by it, so two runs with different counts may differ in the last bit
print(json.dumps({"losses": losses, "params": digest, "peak": peak, "threads": torch.get_num_threads()}))
