# Source this on a GPU host before running the exp/ scripts from the repository root:
#   . exp/gpu_env.sh
# Keeps NVLink multicast off (NCCL_NVLS_ENABLE=0) and makes `import hidup` and `import exp` (the drivers'
# package, not installed: it comes from this checkout) work: an editable install of hidup where pip can
# build one, else a link tree on PYTHONPATH (hosts without network or setuptools).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
if ! (cd /tmp && python3 -c "import hidup.search, hidup.codegen, hidup.profiler, exp.baselines") 2>/dev/null; then
  if ! python3 -m pip install -q --no-deps --no-build-isolation -e . >/tmp/hidup_pip.log 2>&1 \
     || ! (cd /tmp && python3 -c "import hidup.search, exp.baselines") 2>/dev/null; then
    _links=/tmp/hidup_links
    rm -rf "$_links" && mkdir -p "$_links/hidup"
    for _f in "$PWD"/hidup/*; do ln -s "$_f" "$_links/hidup/"; done
    for _p in search codegen profiler; do ln -s "$PWD/$_p" "$_links/hidup/$_p"; done
    export PYTHONPATH="$_links${PYTHONPATH:+:$PYTHONPATH}"
  fi
fi
(cd /tmp && python3 -c "import hidup.search, exp.baselines, torch; print('hidup ready; torch', torch.__version__, 'GPUs', torch.cuda.device_count())")
