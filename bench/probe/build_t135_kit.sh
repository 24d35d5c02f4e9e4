#!/usr/bin/env bash
# Builds .devkit/t135, the experiment kit bench/probe/wide_ctas.sh runs on (one device call, ~62 MB):
# tileiras 13.5 with the ptxas and libnvvm of CUDA 13.5, cuda-tile 1.7.0, and a sitecustomize that lets
# cuda-tile 1.7.0 emit 13.5 bytecode when TILE135=1. cuda-tile 1.7.0 lists 13.5 bytecode only among its
# dev features; num_worker_warps 16 and 32 need it. For measurements only: the library does not use this kit.
#   bash bench/probe/build_t135_kit.sh      # from the project root (needs bash ../shared/devkit/build.sh first)
#   then on the device: carry [".devkit/t135"], `source .devkit/t135/setup.sh && bash bench/probe/wide_ctas.sh`
set -euo pipefail
K=.devkit/t135; V=13.5.37; W=$(mktemp -d)
[ -f .devkit/2/cuda_tile-1.7.0-cp312-cp312-manylinux2014_x86_64.whl ] || { echo "build the devkit first"; exit 1; }
python3 -m pip download -q --no-deps -d "$W/dl" nvidia-cuda-tileiras==$V nvidia-cuda-nvcc==$V nvidia-nvvm==$V
for w in tileiras nvcc nvvm; do mkdir -p "$W/w_$w" && (cd "$W/w_$w" && python3 -m zipfile -e "$W"/dl/nvidia_*${w}-$V-*.whl .); done
mkdir -p "$W/tk/bin" "$W/tk/lib" "$K/site"
cp "$W/w_tileiras/nvidia/cu13/bin/tileiras" "$W/w_nvcc/nvidia/cu13/bin/ptxas" "$W/tk/bin/"
cp "$W/w_nvvm/nvidia/cu13/lib/libnvvm.so.4" "$W/tk/lib/"; chmod +x "$W"/tk/bin/*
(cd "$W/tk" && tar cf - bin lib | xz -9e -T2 > "$OLDPWD/$K/tileiras_kit.tar.xz")
cp .devkit/2/cuda_tile-1.7.0-*.whl "$K/"
cat > "$K/site/sitecustomize.py" <<'PY'
import os
if os.environ.get("TILE135"):  # experiment only: 13.5 bytecode from cuda-tile 1.7.0 (a dev feature there)
    import cuda.tile._compile as _c
    from cuda.tile._bytecode.version import BytecodeVersion as _B
    if _B.V_13_5 not in _c._SUPPORTED_VERSIONS:
        _c._SUPPORTED_VERSIONS.append(_B.V_13_5)
PY
cat > "$K/setup.sh" <<'SH'
# Experiment kit, one part: `source .devkit/t135/setup.sh && <cmd>` (carry [".devkit/t135"]).
D=/tmp/devkit; mkdir -p $D/site $D/tk $D/site135
tar xJf .devkit/t135/tileiras_kit.tar.xz -C $D/tk || return 1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target $D/site .devkit/t135/*.whl || return 1
cp .devkit/t135/site/sitecustomize.py $D/site135/
cat > $D/env.sh <<'ENV'
unset CUDA_HOME CUDA_PATH
export PATH=/tmp/devkit/tk/bin:$PATH
export PYTHONPATH=$PWD:/tmp/devkit/site:/tmp/devkit/site135${PYTHONPATH:+:$PYTHONPATH}
export PYTHONUNBUFFERED=1 CUDA_TILE_CACHE_DIR=/tmp/devkit/cutile-cache TILE135=1
ENV
source $D/env.sh
python3 -c "import torch, cuda.tile._compile as c; print('kit t135:', torch.cuda.get_device_name(), c._SUPPORTED_VERSIONS[-1], c._find_compiler_bin().path)"
SH
rm -rf "$W"; du -sh "$K"
