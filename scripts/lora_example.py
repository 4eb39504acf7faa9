"""LoRA fine-tuning of a Hugging Face causal LM, resumably: only the adapter and its optimizer are checkpointed.

The frozen base is not written into checkpoints: each one records the base's tensors by sha256, and a resume
checks that this script built the same base (a different one is refused with the tensor's name, exit 2).

Runs offline: the model is a tiny Llama built from a config with random weights (seeded), and the data is random
token sequences. For a real run, load your base with ``from_pretrained`` instead and keep everything else::

    pip install 'resumable[lora]'                  # transformers and peft
    python scripts/lora_example.py --run-dir runs/lora
    # kill it at any moment (Ctrl-C, kill -9, a Colab timeout) and run the same command again

``--perturb-base`` changes one base weight (to see the refusal); ``--train-head`` also trains ``lm_head`` (a
``requires_grad`` change, refused on resume as well).
"""

from __future__ import annotations

import argparse
import sys
import time

import torch


def build(seed: int, perturb_base: bool, train_head: bool):  # noqa: ANN201 - a peft model
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)  # stands in for from_pretrained: the same base weights on every start
    config = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    base = LlamaForCausalLM(config)
    if perturb_base:
        with torch.no_grad():
            base.model.layers[1].mlp.down_proj.weight[0, 0] += 1e-3
    model = get_peft_model(base, LoraConfig(r=8, lora_alpha=16, lora_dropout=0.1,
                                            target_modules=["q_proj", "v_proj"]))
    if train_head:
        model.base_model.model.lm_head.weight.requires_grad_(True)
    return model


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--run-dir", default="runs/lora")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--max-steps", type=int, default=None)
    parser.add_argument("--checkpoint-steps", type=int, default=4)
    parser.add_argument("--store-frozen", action="store_true", help="store the base in checkpoints too")
    parser.add_argument("--perturb-base", action="store_true")
    parser.add_argument("--train-head", action="store_true")
    parser.add_argument("--step-sleep", type=float, default=0.0, help="seconds per step (to kill it by hand)")
    args = parser.parse_args(argv)

    import resumable
    from resumable.errors import ResumableError

    model = build(0, args.perturb_base, args.train_head)
    tokens = torch.randint(0, 256, (96, 17), generator=torch.Generator().manual_seed(1))
    data = torch.utils.data.TensorDataset(tokens)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    try:
        run = resumable.Run(args.run_dir, model=model, optimizer=optimizer, data=data, batch_size=8,
                            epochs=args.epochs, seed=3,
                            checkpointing=resumable.Checkpointing(steps=args.checkpoint_steps, every=None,
                                                                  store_frozen=args.store_frozen),
                            session=resumable.Session(max_steps=args.max_steps),
                            reporting=resumable.Reporting(progress=False))
        for _epoch, _step, (batch,) in run:
            loss = model(input_ids=batch, labels=batch).loss  # the model shifts the labels itself
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            run.log(loss)
            if args.step_sleep:
                time.sleep(args.step_sleep)
    except ResumableError as e:
        print(f"error: {e}", file=sys.stderr)
        return e.exit_code
    return run.exit_code


if __name__ == "__main__":
    sys.exit(main())
