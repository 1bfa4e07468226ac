"""train.py with parallel4d inside DeepSpeed: 2D tensor parallelism and ring attention (parallel: in the YAML).

    torchrun --standalone --nproc-per-node 8 examples/deepspeed/train_parallel4d.py examples/deepspeed/job.yaml

Four lines differ from train.py: the mesh, the model, mpu=, and the batch shards.
"""

import sys

import deepspeed
import torch

import parallel4d
from parallel4d.data.batches import build_dataset
from parallel4d.integrations.deepspeed import as_mpu, avoid_compiled_ops


def main(path: str) -> None:
    cfg = parallel4d.load_config(path)
    avoid_compiled_ops()  # no JIT-built DeepSpeed op (it would need a C++ compiler)
    deepspeed.init_distributed(dist_backend="gloo" if not torch.cuda.is_available() else "nccl")
    mesh = parallel4d.init_mesh(pp=cfg.parallel.pp, dp=cfg.parallel.dp, sp=cfg.parallel.sp, tp=cfg.parallel.tp)
    model = parallel4d.build_model(cfg, mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.optimizer.lr)
    ds_config = {"train_batch_size": cfg.data.batch_size, "gradient_accumulation_steps": 1,
                 "gradient_clipping": 1.0, "zero_optimization": {"stage": 1}, "zero_allow_untested_optimizer": True}
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=ds_config, mpu=as_mpu(mesh))
    data = build_dataset(cfg)
    for step in range(cfg.train.steps):
        tokens, targets = data.batch(step)
        loss = engine(parallel4d.local_batch(mesh, tokens, cfg.sequence.layout),
                      parallel4d.local_batch(mesh, targets, cfg.sequence.layout))
        engine.backward(loss)
        engine.step()
        if torch.distributed.get_rank() == 0:
            print(f"step {step + 1} loss {loss.item():.10f}", flush=True)
    # joins the communication threads before the interpreter exits (one still dropping a finished gloo work
    # while Python finalizes aborts the process: "terminate called without an active exception")
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
