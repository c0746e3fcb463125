#!/usr/bin/env bash
# The wheels the GPU run carries: the GPU image (Python 3.12, torch 2.11 cu130, transformers
# 5.17, no network) lacks the web stack `vattn serve` needs, and FlashAttention 4.
#
#   bash benchmarks/gpu_wheels.sh          # .whl/: vattn serve's wheels (about 5 MB)
#   bash benchmarks/gpu_wheels.sh --fa4    # and .fa4/a, .fa4/b: FlashAttention 4 (about 100 MB, two calls)
#   bash benchmarks/gpu_wheels.sh --check  # only check what is there (each wheel's Requires-Dist)
#
# Every wheel is pinned, for CPython 3.12 on manylinux x86-64, downloaded with --no-deps
# (the device tool's notes): exactly these, nothing resolved on the way. Each wheel's
# Requires-Dist is checked at the end against the carried wheels (name and version) and the
# image's package list (names: KINDS.md lists no versions; the suite's install step checks
# the versions there). The folders are git-ignored; carry them with the device tool's `run`:
#   call 1 (the suite):        carry [".whl", ".fa4/a"]   (the suite installs .whl into /tmp/site
#                              and keeps .fa4/a, the first half of nvidia-cutlass-dsl-libs-cu13,
#                              under /tmp/fa4 on the machine)
#   call 2 (FlashAttention 4): carry [".fa4/b"]           (the other FA4 wheels and the second
#                              half; joined to the first there: benchmarks/gpu_fa4.sh)
# docs/gpu.md "The next run" has the two commands. Python: PYTHON (default python3), with pip.
set -euo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$REPO"
PY=${PYTHON:-python3}
FA4=0
CHECK_ONLY=0
for a in "$@"; do
    case $a in
        --fa4) FA4=1 ;;
        --check) CHECK_ONLY=1 ;;
        *) echo "usage: bash benchmarks/gpu_wheels.sh [--fa4] [--check]" >&2; exit 2 ;;
    esac
done

# `vattn serve` = transformers serve 5.17: is_serve_available() wants pydantic, fastapi, uvicorn
# and openai (its routes import openai.types); vattn.integrations.hf_serve.SERVING_PACKAGES also
# typer (in the image). Versions chosen so that nothing else is needed: fastapi 0.140 (0.150 on
# wants opentelemetry-api), openai 2.x (3.x wants httpx2/httpcore2/truststore; 2.x the image's
# httpx), pydantic 2.12 (2.14 wants typing-extensions >= 4.16). typing-extensions is NOT
# carried: openai and pydantic want >= 4.14.1, and a carried one would shadow the image's (the
# rehearsal found anyio 4.16 importing typing_extensions.sentinel, new in 4.16: a carried 4.15
# broke it); the suite's install step checks the image's version against every Requires-Dist.
SERVE_WHEELS=(
    fastapi==0.140.0 starlette==0.50.0 uvicorn==0.40.0
    pydantic==2.12.5 pydantic-core==2.41.5 annotated-types==0.7.0 typing-inspection==0.4.2
    openai==2.54.0 jiter==0.12.0 distro==1.9.0 sniffio==1.3.1 prometheus-client==0.23.1
)
# FlashAttention 4 (flash_attn.cute): the CuTe-DSL kernels and their compiler. The
# nvidia-cutlass-dsl meta wheel names -libs-cu12 without an extra; the cu13 libraries are the
# ones for this driver (CUDA 13), installed with --no-deps. einops, cuda-bindings, protobuf
# and torch are in the image.
FA4_WHEELS=(
    flash-attn-4==4.0.0b36 quack-kernels==0.6.5 apache-tvm-ffi==0.1.11 torch-c-dlpack-ext==0.1.5
    nvidia-cutlass-dsl==4.8.1 nvidia-cutlass-dsl-libs-base==4.8.1 nvidia-cutlass-dsl-libs-core==4.8.1
)
FA4_BIG=nvidia-cutlass-dsl-libs-cu13==4.8.1  # 92 MB: carried in two parts, one per call (below)

PLATFORMS=(--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64
           --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64)
download() {  # DIR NAME==VERSION...
    local dir=$1
    shift
    mkdir -p "$dir"
    "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        "${PLATFORMS[@]}" -d "$dir" "$@" 2> >(grep -v "is ignored: it is neither" >&2)
}

if [ $CHECK_ONLY = 0 ]; then
    rm -rf .whl
    download .whl "${SERVE_WHEELS[@]}"
    if [ $FA4 = 1 ]; then
        rm -rf .fa4
        download .fa4/b "${FA4_WHEELS[@]}"  # the small wheels go with the second part
        mkdir -p .fa4/a
        download .fa4/big "$FA4_BIG"
        big=$(ls .fa4/big/*.whl)
        # The wheel (92 MB) is over one call's 64 MiB. Its files, as pip would install them,
        # go into one tar.xz (about 61 MiB: xz packs the MLIR libraries far better than the
        # wheel's zip; about 4 minutes here), split in two halves of about 30 MiB, one per call:
        # `cat part1 part2 | tar -xJ -C /tmp/site` there is the install. The sha256 of the
        # joined archive is checked there first.
        mkdir -p .fa4/big/files .fa4/b
        (cd .fa4/big/files && "$PY" -c "import sys, zipfile; zipfile.ZipFile(sys.argv[1]).extractall('.')" "$REPO/$big")
        tar -C .fa4/big/files -cf - . | xz -9 -T0 -c >.fa4/big/cu13.tar.xz
        half=$(( ($(stat -c %s .fa4/big/cu13.tar.xz) + 1) / 2 ))
        split -b "$half" -d -a 1 .fa4/big/cu13.tar.xz .fa4/big/part
        mv .fa4/big/part0 .fa4/a/cutlass-dsl-libs-cu13.tar.xz.part1
        mv .fa4/big/part1 .fa4/b/cutlass-dsl-libs-cu13.tar.xz.part2
        sha256sum .fa4/big/cu13.tar.xz | awk '{print $1}' >.fa4/b/cutlass-dsl-libs-cu13.tar.xz.sha256
        rm -rf .fa4/big
    fi
fi

# Each wheel's Requires-Dist against the carried wheels and the image's packages.
"$PY" - .whl .fa4/a .fa4/b <<'EOF'
import re, sys, zipfile
from pathlib import Path
from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

# The image's packages (the device tool's KINDS.md, read 2026-11-17; names only).
IMAGE = set(map(canonicalize_name, """absl-py accelerate aiofiles aiohappyeyeballs aiohttp aiosignal annotated-doc anyio
attrs botorch build certifi charset-normalizer chex click cloudpickle cmake colorama contourpy coverage cuda-bindings
cuda-core cuda-pathfinder cuda-toolkit cupy-cuda13x cycler cython diffrax e3nn einops equinox etils execnet filelock
flatbuffers flax fonttools formulaic frozenlist fsspec gpytorch grpcio h11 h5py hf-xet httpcore httpx huggingface-hub
humanize hypothesis idna imageio iniconfig interface-meta jax jax-cuda13-pjrt jax-cuda13-plugin jaxlib jaxtyping jinja2
joblib kiwisolver lazy-loader lightning lightning-utilities linear-operator lineax llvmlite lxml markdown
markdown-it-py markupsafe matplotlib mdurl meson ml-dtypes mpi4py mpmath msgpack multidict multipledispatch
mypy-extensions nanobind narwhals networkx ninja numba numba-cuda numpy numpyro nvidia-cublas nvidia-cuda-cupti
nvidia-cuda-nvrtc nvidia-cuda-runtime nvidia-cudnn-cu13 nvidia-cufft nvidia-cufile nvidia-curand nvidia-cusolver
nvidia-cusparse nvidia-cusparselt-cu13 nvidia-ml-py nvidia-nccl-cu13 nvidia-nvjitlink nvidia-nvshmem-cu13 nvidia-nvtx
onnx onnx-ir onnxruntime onnxscript opencv-python-headless optax opt-einsum opt-einsum-fx optimistix
orbax-checkpoint packaging pandas pathspec patsy peft pillow pip pluggy portalocker prometheus-client propcache
protobuf psutil pyarrow pybind11 py-cpuinfo pygments pyparsing pyproject-hooks pyre-extensions pytest
pytest-benchmark pytest-cov pytest-mock pytest-timeout pytest-xdist python-dateutil pytorch-lightning pyyaml regex
requests rich sacrebleu safetensors scikit-build-core scikit-image scikit-learn scipy seaborn sentencepiece
sentence-transformers setuptools shellingham simplejson six sortedcontainers statsmodels sympy tabulate tensorboard
tensorboard-data-server tensorstore threadpoolctl tifffile tiktoken timm tokenizers toolz torch torchaudio
torchdiffeq torch-geometric torchmetrics torchvision tqdm transformers treescope triton typer typing-extensions
typing-inspect urllib3 uvloop wadler-lindig werkzeug wheel wrapt xarray xxhash yarl zipp""".split()))
# Named without an extra but not wanted: the cu12 libraries of the CuTe DSL (the cu13 ones are carried).
NOT_NEEDED = {"nvidia-cutlass-dsl-libs-cu12"}
env = dict(default_environment(), python_version="3.12", python_full_version="3.12.3", sys_platform="linux",
           platform_system="Linux", platform_machine="x86_64", implementation_name="cpython", extra="")

carried: dict[str, tuple[Version, Path]] = {}
metas = []
for d in map(Path, sys.argv[1:]):
    for w in sorted(d.glob("*.whl")):
        name, version = w.name.split("-")[:2]
        carried[canonicalize_name(name)] = (Version(version), w)
        if w.suffix == ".whl":
            with zipfile.ZipFile(w) as z:
                meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
                metas.append((w, z.read(meta).decode()))
if Path(sys.argv[3], "cutlass-dsl-libs-cu13.tar.xz.part2").exists():  # the big wheel, as a split tar.xz
    carried["nvidia-cutlass-dsl-libs-cu13"] = (Version("4.8.1"), Path(sys.argv[2], "cutlass-dsl-libs-cu13.tar.xz.part1"))
problems, image_needs = [], set()
for w, text in metas:
    for line in re.findall(r"^Requires-Dist: (.+)$", text, re.M):
        req = Requirement(line)
        if req.marker is not None and not req.marker.evaluate(env):
            continue  # an extra, another Python or platform
        name = canonicalize_name(req.name)
        if name in carried:
            if carried[name][0] not in req.specifier:
                problems.append(f"{w.name}: wants {req}, carried {carried[name][0]}")
        elif name in IMAGE:
            image_needs.add(str(req))
        elif name not in NOT_NEEDED:
            problems.append(f"{w.name}: wants {req}: neither carried nor in the image")
total = sum(p.stat().st_size for _, p in carried.values())
print(f"{len(carried)} wheels carried ({total / 2**20:.1f} MiB, the second half of the tar.xz not counted); "
      f"from the image: {', '.join(sorted(image_needs))}")
if problems:
    print("PROBLEMS:\n  " + "\n  ".join(problems))
    sys.exit(1)
print("every Requires-Dist is met by a carried wheel or a package of the image")
EOF

# What each call carries, with the tree that travels (tracked and untracked files, not ignored ones).
tree=$(git ls-files -z --cached --others --exclude-standard | xargs -0 du -cb 2>/dev/null | tail -1 | cut -f1)
mib() { echo $(( ($1 + 1048575) / 1048576 )); }
size() { du -cb "$@" 2>/dev/null | tail -1 | cut -f1; }
echo "the tree that travels: $(mib "$tree") MiB"
a=0; [ -d .fa4/a ] && a=$(size .fa4/a)
echo "call 1 carries .whl$( [ -d .fa4/a ] && echo " and .fa4/a"): $(mib $(( tree + $(size .whl) + a ))) MiB of 64"
if [ -d .fa4/b ]; then echo "call 2 carries .fa4/b: $(mib $(( tree + $(size .fa4/b) ))) MiB of 64"; fi
exit 0
