"""A plain DeepSpeed training script on the dense GPT (one process, or torchrun for data parallelism).

    torchrun --standalone --nproc-per-node 1 examples/deepspeed/train.py examples/deepspeed/job.yaml

train_parallel4d.py is this script with the model, mpu and batch lines changed.
"""

import sys

import deepspeed
import torch

import parallel4d
from parallel4d.data.batches import build_dataset
from parallel4d.engine.model import model_shape
from parallel4d.integrations.deepspeed import avoid_compiled_ops
from parallel4d.models.gpt2.model import build_gpt


def main(path: str) -> None:
    cfg = parallel4d.load_config(path)
    avoid_compiled_ops()  # no JIT-built DeepSpeed op (it would need a C++ compiler)
    deepspeed.init_distributed(dist_backend="gloo" if not torch.cuda.is_available() else "nccl")
    model = build_gpt(model_shape(cfg), seed=cfg.train.seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.optimizer.lr)
    ds_config = {"train_batch_size": cfg.data.batch_size, "gradient_accumulation_steps": 1,
                 "gradient_clipping": 1.0, "zero_optimization": {"stage": 1}, "zero_allow_untested_optimizer": True}
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=ds_config)
    data = build_dataset(cfg)
    for step in range(cfg.train.steps):
        tokens, targets = data.batch(step)
        loss = engine(tokens, targets)
        engine.backward(loss)
        engine.step()
        if torch.distributed.get_rank() == 0:
            print(f"step {step + 1} loss {loss.item():.10f}", flush=True)
    # joins the communication threads before the interpreter exits (one still dropping a finished gloo work
    # while Python finalizes aborts the process: "terminate called without an active exception")
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
