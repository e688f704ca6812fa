"""The entrypoint of examples/launch/rayjob.yaml: sao's multi-node shape on a Ray cluster. vLLM servers run on the nodes
that offer the custom resource ``sao_vllm`` (examples/launch/vllm_node.sh: one server per GPU), torchrun on the
nodes that offer ``sao_trainer`` (one rank per GPU, c10d rendezvous hosted by the first), and the trainer samples
from every server through --vllm-url: the same processes as examples/launch/slurm.sbatch, placed by Ray.

    python examples/launch/ray_launch.py --trainer-nodes 2 --vllm-nodes 1 --gpus-per-node 8 \\
        --model /shared/models/Qwen2.5-7B-Instruct -- --rollout vllm --out /shared/runs/sao-7b

Everything after ``--`` goes to ``sao train`` (--model and --vllm-url are added). The run folder and the model must
be on a volume every pod mounts at the same path: the servers load each published adapter or full-weight version
by its path. Ray only places and starts the processes; the training is torchrun's. Left out: replacing a node
that dies (the job fails; submit it again with --resume among the sao flags).
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]  # the sao checkout: at the same path in every pod's image
TRAINER, VLLM = "sao_trainer", "sao_vllm"  # the custom resources the manifest's worker groups offer
RDZV_PORT, VLLM_PORT = 29500, 8000


def trainer_command(
    *,
    nodes: int,
    gpus: int,
    head: str,
    run_id: str,
    model: str,
    urls: list[str],
    sao_args: list[str],
    python: str = ".venv/bin/python",
) -> list[str]:
    """The command every trainer node runs: torchrun joining the others at ``head``, then ``sao train``."""
    return [
        python,
        "-m",
        "torch.distributed.run",
        "--nnodes",
        str(nodes),
        "--nproc-per-node",
        str(gpus),
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        f"{head}:{RDZV_PORT}",
        "--rdzv-id",
        run_id,
        "-m",
        "sao",
        "train",
        "--model",
        model,
        "--vllm-url",
        ",".join(urls),
        *sao_args,
    ]


def server_urls(ips: list[str], gpus: int) -> list[str]:
    return [f"http://{ip}:{VLLM_PORT + i}" for ip in ips for i in range(gpus)]


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--trainer-nodes", type=int, required=True)
    p.add_argument("--vllm-nodes", type=int, required=True)
    p.add_argument("--gpus-per-node", type=int, required=True)
    p.add_argument("--model", required=True, help="a folder (or hub id in a shared HF_HOME) every pod can read")
    p.add_argument("--startup-timeout", type=float, default=1200.0, help="seconds for the vLLM servers to come up")
    p.add_argument("sao_args", nargs=argparse.REMAINDER, help="-- then sao train's flags")
    return p


def main(argv: list[str] | None = None) -> int:
    import ray

    args = parser().parse_args(argv)
    sao_args = args.sao_args[1:] if args.sao_args[:1] == ["--"] else args.sao_args
    gpus = args.gpus_per_node
    ray.init()

    @ray.remote(num_cpus=0, num_gpus=gpus, resources={VLLM: 1})
    class VllmNode:
        def start(self, model: str) -> str:
            script = str(ROOT / "examples" / "launch" / "vllm_node.sh")
            self.process = subprocess.Popen(
                ["bash", script, model, str(gpus), str(VLLM_PORT)], cwd=ROOT, start_new_session=True
            )
            return ray.util.get_node_ip_address()

        def stop(self) -> None:
            if getattr(self, "process", None) is not None and self.process.poll() is None:
                os.killpg(self.process.pid, signal.SIGTERM)

    @ray.remote(num_cpus=0, num_gpus=gpus, resources={TRAINER: 1})
    class TrainerNode:
        def ip(self) -> str:
            return ray.util.get_node_ip_address()

        def run(self, command: list[str]) -> int:
            return subprocess.run(command, cwd=ROOT, check=False).returncode

    servers = [VllmNode.remote() for _ in range(args.vllm_nodes)]
    trainers = [TrainerNode.remote() for _ in range(args.trainer_nodes)]
    try:
        urls = server_urls(ray.get([s.start.remote(args.model) for s in servers]), gpus)
        give_up = time.monotonic() + args.startup_timeout
        for url in urls:
            while True:
                try:
                    urllib.request.urlopen(f"{url}/health", timeout=5).close()
                    break
                except OSError:
                    if time.monotonic() > give_up:
                        print(f"sao: {url} not up after {args.startup_timeout:g} s", file=sys.stderr)
                        return 1
                    time.sleep(10)
        ips = ray.get([t.ip.remote() for t in trainers])
        run_id = f"sao-{os.getpid()}-{int(time.time())}"
        command = trainer_command(
            nodes=len(trainers), gpus=gpus, head=ips[0], run_id=run_id, model=args.model, urls=urls, sao_args=sao_args
        )
        codes = ray.get([t.run.remote(command) for t in trainers])
        return max(codes)
    finally:
        ray.get([s.stop.remote() for s in servers], timeout=60)


if __name__ == "__main__":
    raise SystemExit(main())
