"""The docs a newcomer reads are current and short: the README under 200 lines with its Python example running as
printed, the settings reference generated from the config (``make docs`` rewrites it; the suite only checks),
module docstrings short, and no code pointing at a SPEC file the project does not have. The launch examples
(examples/launch/) run what they say: every sao command in them parses with sao's own parser, the vLLM server
command with vLLM's, the shell scripts are valid bash, and the RayJob manifest's shape (nodes, GPUs, custom
resources, Ray version) is the one its entrypoint asks for (running them needs a cluster: not done here)."""

from __future__ import annotations

import ast
import importlib.util
import json
import os
import re
import shlex
import string
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SETTINGS = ROOT / "docs" / "settings.md"


def test_the_readme_is_short():
    assert len((ROOT / "README.md").read_text().splitlines()) <= 200


def test_the_settings_reference_is_generated_from_the_config():
    from sao.cli import settings_reference

    text = settings_reference()
    if os.environ.get("SAO_WRITE_DOCS") == "1":
        SETTINGS.write_text(text)
    assert SETTINGS.read_text() == text, "docs/settings.md is not the config's: run `make docs` and commit it"


def test_make_docs_rewrites_every_page_a_test_checks():
    """A test that rewrites its page under SAO_WRITE_DOCS=1 is one ``make docs`` runs: named in its recipe (the
    fault table is the fault tests' hook, which ``-m faults`` runs)."""
    recipe = re.search(r"^docs:.*?\n((?:\t.*\n)+)", (ROOT / "Makefile").read_text(), flags=re.M)
    assert recipe is not None and "-m faults" in recipe.group(1)

    def reads_the_switch(test: ast.FunctionDef) -> bool:  # os.environ.get("SAO_WRITE_DOCS") somewhere in it
        calls = (n for n in ast.walk(test) if isinstance(n, ast.Call) and n.args)
        return any(isinstance(c.args[0], ast.Constant) and c.args[0].value == "SAO_WRITE_DOCS" for c in calls)

    writers = [
        f"{path.relative_to(ROOT)}::{node.name}"
        for path in sorted((ROOT / "tests").rglob("test_*.py"))
        for node in ast.parse(path.read_text()).body
        if isinstance(node, ast.FunctionDef) and reads_the_switch(node)
    ]
    assert len(writers) >= 2 and [w for w in writers if w not in recipe.group(1)] == []


def test_no_module_points_at_a_spec_file():
    found = [str(p.relative_to(ROOT)) for p in (ROOT / "src").rglob("*.py") if re.search(r"SPEC §", p.read_text())]
    assert found == []


def test_module_docstrings_are_short():
    long = []
    for path in (ROOT / "src" / "sao").rglob("*.py"):
        doc = ast.get_docstring(ast.parse(path.read_text())) or ""
        if len(doc.splitlines()) > 20:
            long.append(f"{path.relative_to(ROOT)}: {len(doc.splitlines())} lines")
    assert long == [], "module docstrings over 20 lines (the essay belongs in docs/design/):\n" + "\n".join(long)


def _readme_block(marker: str) -> str:
    text = (ROOT / "README.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, flags=re.S)
    return next(b for b in blocks if marker in b)


def test_the_readme_python_example_trains_on_user_rows_with_a_user_reward(tmp_path, monkeypatch, tiny_model_dir):
    monkeypatch.chdir(tmp_path)
    namespace: dict = {"__name__": "__main__"}
    exec(compile(_readme_block("sao.train("), "README.md", "exec"), namespace)
    run = namespace["run"]
    assert len(run.records) == 10 + 4 and (tmp_path / "runs" / "mine" / "adapter").is_dir()
    import json

    record = json.loads((tmp_path / "runs" / "mine" / "config.json").read_text())
    assert record["replayable"] is False and any("reward_fn" in r for r in record["not_replayable"])
    assert record["passed"]["dataset"].startswith("64 rows passed in")


def test_the_readme_algorithm_example_runs():
    exec(compile(_readme_block("SAO("), "README.md", "exec"), {"__name__": "__main__"})


@pytest.mark.parametrize("doc", sorted(p.name for p in (ROOT / "docs").glob("*.md")))
def test_docs_link_to_files_that_exist(doc):
    text = (ROOT / "docs" / doc).read_text()
    for target in re.findall(r"\]\(([^)#:]+)\)", text):
        assert (ROOT / "docs" / target).exists(), f"docs/{doc} links to {target}, which does not exist"


@pytest.mark.parametrize(
    "doc",
    [
        "README.md",
        "docs/vllm.md",
        "docs/agents.md",
        "docs/traces-and-serving.md",
        "docs/experiments.md",
        "docs/scale-out.md",
        "docs/timeline.md",
    ],
)
def test_every_sao_command_in_the_docs_parses_as_printed(doc):
    """Each ``sao ...`` line of a bash block is a command the CLI accepts: its command and every flag exist and
    take the values shown (running them is the recipe's and the tests' business)."""
    import shlex

    from sao.cli import build_parser

    text = (ROOT / doc).read_text()
    blocks = [block.replace("\\\n", " ") for block in re.findall(r"```bash\n(.*?)```", text, re.S)]  # continuations
    lines = [line.strip() for block in blocks for line in block.splitlines()]
    lines = [line for line in lines if line.startswith("sao ") and "<" not in line and "..." not in line]
    parser = build_parser()
    for line in lines:
        argv = shlex.split(line, comments=True)[1:]
        try:
            parser.parse_args(argv)
        except SystemExit as refused:
            raise AssertionError(f"{doc}: `{line}` is refused by the CLI") from refused


# ---------------------------------------------------------------------------------------------------------------
# The launch examples

LAUNCH = ROOT / "examples" / "launch"
# What Slurm and the script itself set at run time, as they would look on a 3-node allocation.
RUNTIME = {
    "SLURM_JOB_ID": "4242",
    "HEAD": "node1",
    "VLLM_URLS": "http://node3:8000,http://node3:8001",
    "RESUME": "--resume",
    "RDZV_PORT": "29500",
}


def _sao_argv(command: str) -> list[str]:
    """The arguments after ``sao`` (or ``-m sao``) in a shell command line."""
    words = shlex.split(command)
    return words[words.index("sao") + 1 :]


def _parses(argv: list[str], where: str) -> None:
    from sao.cli import build_parser

    try:
        build_parser().parse_args(argv)
    except SystemExit as refused:
        raise AssertionError(f"{where}: `sao {shlex.join(argv)}` is refused by the CLI") from refused


def _logical_lines(path: Path) -> list[str]:
    return path.read_text().replace("\\\n", " ").splitlines()


def _defaults(text: str) -> dict[str, str]:
    """VAR="${VAR:-default}" assignments: each variable's default, the others expanded in it."""
    found: dict[str, str] = {}
    for name, default in re.findall(r'^(\w+)="\$\{\1:-(.*)\}"', text, flags=re.M):
        found[name] = string.Template(default).safe_substitute({**RUNTIME, **found})
    return found


@pytest.mark.parametrize("script", ["slurm.sbatch", "vllm_node.sh"])
def test_the_shell_scripts_are_valid_bash(script):
    done = subprocess.run(["bash", "-n", str(LAUNCH / script)], capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr


def test_every_sao_command_of_the_slurm_script_parses_with_its_defaults_and_its_examples():
    path = LAUNCH / "slurm.sbatch"
    text = path.read_text()
    values = {**RUNTIME, **_defaults(text)}
    commands = [line[line.index("-m sao ") :] for line in _logical_lines(path) if "-m sao " in line]
    assert len(commands) == 1, commands  # the trainer's torchrun line
    argv = _sao_argv(string.Template(commands[0]).safe_substitute(values))
    assert "$" not in " ".join(argv), argv
    _parses(argv, "slurm.sbatch")
    assert argv[0] == "train" and argv[argv.index("--vllm-url") + 1] == RUNTIME["VLLM_URLS"]
    examples = re.findall(r'^#\s+EXTRA="([^"]+)" sbatch', text, flags=re.M)
    assert examples, "the header shows EXTRA in use"
    for extra in examples:
        _parses(argv + shlex.split(extra), "slurm.sbatch (EXTRA example)")


def _ray_launch():
    spec = importlib.util.spec_from_file_location("sao_ray_launch", LAUNCH / "ray_launch.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # imports nothing of Ray until main() runs
    return module


def test_the_rayjob_asks_for_the_shape_its_worker_groups_have_and_its_sao_command_parses():
    import yaml

    launch = _ray_launch()
    job = yaml.safe_load((LAUNCH / "rayjob.yaml").read_text())
    entrypoint = shlex.split(job["spec"]["entrypoint"])
    assert entrypoint[:2] == ["python", "examples/launch/ray_launch.py"]
    args = launch.parser().parse_args(entrypoint[2:])
    sao_args = args.sao_args[1:] if args.sao_args[:1] == ["--"] else args.sao_args
    urls = launch.server_urls(["10.0.0.3"], args.gpus_per_node)
    command = launch.trainer_command(
        nodes=args.trainer_nodes,
        gpus=args.gpus_per_node,
        head="10.0.0.1",
        run_id="sao-1",
        model=args.model,
        urls=urls,
        sao_args=sao_args,
    )
    _parses(_sao_argv(shlex.join(command)), "rayjob.yaml")
    assert command[command.index("--nnodes") + 1] == "2" and len(urls) == 8

    cluster = job["spec"]["rayClusterSpec"]
    groups = {}
    for group in cluster["workerGroupSpecs"]:
        (resource,) = json.loads(json.loads(group["rayStartParams"]["resources"]))  # KubeRay's quoted JSON
        (container,) = group["template"]["spec"]["containers"]
        gpus = int(container["resources"]["limits"]["nvidia.com/gpu"])
        groups[resource] = (group["replicas"], group["minReplicas"], group["maxReplicas"], gpus)
    assert groups == {
        launch.TRAINER: (args.trainer_nodes,) * 3 + (args.gpus_per_node,),
        launch.VLLM: (args.vllm_nodes,) * 3 + (args.gpus_per_node,),
    }
    pinned = re.search(r"^ray==(\S+)$", (ROOT / "constraints.txt").read_text(), flags=re.M)
    assert pinned and cluster["rayVersion"] == pinned.group(1), "rayVersion is the Ray sao installs"


@pytest.mark.slow
def test_the_vllm_server_command_parses_with_vllms_own_parser():
    from sao.rollout.vllm import default_vllm_python

    python = default_vllm_python()
    if python is None:
        pytest.skip(".venv-vllm is absent: make install-vllm builds it")
    path = LAUNCH / "vllm_node.sh"
    text = path.read_text()
    (line,) = [line for line in _logical_lines(path) if "vllm.entrypoints.openai.api_server" in line]
    line = line[line.index("vllm.entrypoints.openai.api_server") :].split(">")[0].replace("$((PORT + i))", "8001")
    values = {**_defaults(text), "MODEL": "/models/m", "i": "1"}
    argv = shlex.split(string.Template(line).safe_substitute(values))[1:]
    assert "$" not in " ".join(argv) and "--logprobs-mode" in argv and "--enable-lora" in argv, argv
    probe = (
        "import sys\n"
        "from vllm.entrypoints.launchers.cli_args import make_arg_parser\n"
        "from vllm.utils.argparse_utils import FlexibleArgumentParser\n"
        "args = make_arg_parser(FlexibleArgumentParser()).parse_args(sys.argv[1:])\n"
        "print(args.logprobs_mode, args.dtype)"
    )
    done = subprocess.run([str(python), "-c", probe, *argv], capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split()[-2:] == ["processed_logprobs", "bfloat16"]
