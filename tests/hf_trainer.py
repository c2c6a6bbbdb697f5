"""A user's training script on transformers' ``Trainer``, not written for memfit: a Qwen2 built from its config.

The Trainer's own loop, as people run it: gradient accumulation over 2 micro-batches, gradient
clipping, a linear LR schedule with warm-up, a log line every step (the Trainer reads the loss
with ``.item()``) and an evaluation pass every 10 steps, on random tokens (no download). Like
``hf_train.py`` it prints one JSON line: the logged losses, a digest of the final parameters, and
the peak on a roomy cpu-sim device with ``--measure-peak``.
"""

import argparse
import contextlib
import hashlib
import json
import tempfile

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM, Trainer, TrainerCallback, TrainingArguments

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=20)
parser.add_argument("--measure-peak", action="store_true")
args = parser.parse_args()

torch.manual_seed(0)
config = Qwen2Config(
    hidden_size=128, intermediate_size=256, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
    vocab_size=512, max_position_embeddings=512, attn_implementation="eager",
)  # fmt: skip
model = Qwen2ForCausalLM(config)
generator = torch.Generator().manual_seed(1)


class RandomTokens(torch.utils.data.Dataset):
    def __init__(self, n: int, length: int = 128) -> None:
        self.ids = torch.randint(0, config.vocab_size, (n, length), generator=generator)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


losses: list[float] = []


class KeepLosses(TrainerCallback):
    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "loss" in logs:
            losses.append(float(logs["loss"]))


training = TrainingArguments(
    output_dir=tempfile.mkdtemp(), max_steps=args.steps, per_device_train_batch_size=8, gradient_accumulation_steps=2,
    max_grad_norm=1.0, learning_rate=1e-3, lr_scheduler_type="linear", warmup_steps=2, logging_steps=1,
    eval_strategy="steps", eval_steps=10, per_device_eval_batch_size=8, save_strategy="no", report_to=[],
    use_cpu=True, seed=0, dataloader_num_workers=0, disable_tqdm=True,
)  # fmt: skip
measuring, backend = contextlib.nullcontext(), None
if args.measure_peak:
    from memfit.backends.cpu_sim import CpuSimBackend

    backend = CpuSimBackend(capacity="8GiB")
    measuring = backend.activate()
with measuring:
    trainer = Trainer(
        model=model, args=training, train_dataset=RandomTokens(16 * args.steps), eval_dataset=RandomTokens(16),
        callbacks=[KeepLosses()],
    )  # fmt: skip
    trainer.train()
    digest = hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in model.parameters())).hexdigest()
    peak = backend.max_memory_allocated() if backend is not None else None
print(json.dumps({"losses": losses, "params": digest, "peak": peak}))
