# Before/after in one run: the old tree (.base = c54a3be) and this tree, the same benchmark script (the old
# one, which imports the old module paths: the new tree serves them through cgforge._moved).
# usage: bash .device/bench_ab.sh engine|1m
source .device/base/env.sh > $OUT/env.log 2>&1
B=.base/benchmarks/bench_md_ab.py
run() { tree=$1; shift; if [ "$tree" = base ]; then pp=$PWD/.base; else pp=$PWD; fi
  PYTHONPATH=$pp:/tmp/site:$PWD/.device/base/oeq_src python3 -W ignore::DeprecationWarning $B "$@"; }
case $1 in
engine) for round in 1 2; do for tree in base new; do
  run $tree --systems 5k --models bundled-mace,mace-mp-medium --dtypes float32 --backends cgforge-engine \
      --ensembles nvt --md-steps 200 --md-warmup 20 > $OUT/$tree-engine-$round.log 2>&1
  echo "== $tree round $round"; tail -6 $OUT/$tree-engine-$round.log; done; done ;;
1m) for tree in base new; do
  run $tree --systems 5k,1m --models mace-mp-medium --dtypes float32 --backends cgforge --steps 3 --warmup 1 \
      --nvt-only > $OUT/$tree-1m.log 2>&1
  echo "== $tree"; tail -5 $OUT/$tree-1m.log; done ;;
esac
