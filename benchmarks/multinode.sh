#!/usr/bin/env bash
# A simulated multi-node network on one machine, then compare.py across it.
#
#   sudo benchmarks/multinode.sh [NODES=2] [RATE=1gbit] [compare.py arguments...]
#   sudo benchmarks/multinode.sh 2 1gbit --workloads mlp --configs torch_ddp,minddp_ring
#   sudo SCRIPT=benchmarks/time_to_loss.py benchmarks/multinode.sh 2 1gbit --steps 200
#   sudo SLOW_NODE=2 SLOW_RATE=100mbit benchmarks/multinode.sh 4 1gbit --timeline ...
#
# Loopback makes communication nearly free, which hides what all-reduce
# algorithms and compression are for. This script builds NODES network
# namespaces ("nodes"), each with one veth link into a shared bridge, and
# limits every node's outgoing link to RATE with a token-bucket filter (tc tbf;
# netem is not available everywhere). It then starts one torchrun per node
# (--nnodes=NODES --nproc_per_node=1), rendezvousing on node 0's address, and
# runs benchmarks/compare.py (or $SCRIPT) across them; results go to results/multinode-N/
# (or $OUT). SLOW_NODE=i limits node i's outgoing link to SLOW_RATE instead (default a tenth
# of RATE when RATE is in mbit or gbit): one slow link among equal ones, for
# `python -m minddp.diagnose` to find (docs/troubleshooting.md).
# Timings on a shared machine: run it under `flock /tmp/minddp-bench.lock` so that two
# benchmark runs neither collide on the namespaces nor disturb each other's figures.
# Needs root and iproute2; the namespaces, links and bridge are removed on exit,
# whether the run succeeds or fails.
set -euo pipefail

NODES=${1:-2}
RATE=${2:-1gbit}
shift $(( $# > 2 ? 2 : $# )) || true
ARGS=("$@")
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
SCRIPT=${SCRIPT:-benchmarks/compare.py}
PREFIX=mddp
BRIDGE=${PREFIX}br0
SUBNET=10.77.0
PORT=${PORT:-29577}
OUT=${OUT:-results/multinode-${NODES}}
SLOW_NODE=${SLOW_NODE:-}
tenth() {  # a tenth of a tc rate such as 1gbit or 400mbit, in kbit
    case "$1" in
        *gbit) echo "$(( ${1%gbit} * 100000 ))kbit" ;;
        *mbit) echo "$(( ${1%mbit} * 100 ))kbit" ;;
        *) echo "" ;;
    esac
}
SLOW_RATE=${SLOW_RATE:-$(tenth "$RATE")}

fail() { echo "multinode.sh: $*" >&2; exit 1; }
[ "$(id -u)" = 0 ] || fail "needs root (network namespaces and tc); run it with sudo"
command -v ip >/dev/null && command -v tc >/dev/null || fail "needs iproute2 (ip, tc)"
[ -x "$PY" ] || fail "no $PY: run 'make setup' first"
[[ "$NODES" =~ ^[0-9]+$ ]] && [ "$NODES" -ge 2 ] || fail "NODES must be a number >= 2, got '$NODES'"
if [ -n "$SLOW_NODE" ]; then
    [[ "$SLOW_NODE" =~ ^[0-9]+$ ]] && [ "$SLOW_NODE" -lt "$NODES" ] \
        || fail "SLOW_NODE must be a node number below $NODES, got '$SLOW_NODE'"
    [ -n "$SLOW_RATE" ] || fail "give SLOW_RATE (e.g. 100mbit): no tenth of RATE=$RATE"
fi

cleanup() {
    for pid in $(jobs -p); do kill "$pid" 2>/dev/null || true; done
    for i in $(seq 0 $((NODES - 1))); do
        ip netns del "${PREFIX}n$i" 2>/dev/null || true
        ip link del "${PREFIX}h$i" 2>/dev/null || true
    done
    ip link del "$BRIDGE" 2>/dev/null || true
}
trap cleanup EXIT
cleanup  # leftovers of an earlier run that was killed

ip link add "$BRIDGE" type bridge
ip link set "$BRIDGE" up
for i in $(seq 0 $((NODES - 1))); do
    ns=${PREFIX}n$i
    ip netns add "$ns"
    ip link add "${PREFIX}h$i" type veth peer name eth0 netns "$ns"
    ip link set "${PREFIX}h$i" master "$BRIDGE" up
    ip -n "$ns" addr add "$SUBNET.$((i + 1))/24" dev eth0
    ip -n "$ns" link set eth0 up
    ip -n "$ns" link set lo up
    # Each node's egress is limited: a rank's sends share its node's link.
    rate=$RATE
    [ "$i" = "$SLOW_NODE" ] && rate=$SLOW_RATE
    ip netns exec "$ns" tc qdisc add dev eth0 root tbf rate "$rate" burst 256kb latency 50ms
done
slow=""
[ -z "$SLOW_NODE" ] || slow=" except node $SLOW_NODE's, limited to $SLOW_RATE"
echo "multinode.sh: $NODES nodes on $SUBNET.0/24, each link limited to $RATE$slow (tc tbf)"

mkdir -p "$OUT"
COMMAND="benchmarks/multinode.sh $NODES $RATE ${ARGS[*]}"  # recorded in the result file
[ "$SCRIPT" = benchmarks/compare.py ] || COMMAND="SCRIPT=$SCRIPT $COMMAND"
[ "$OUT" = "results/multinode-${NODES}" ] || COMMAND="OUT=$OUT $COMMAND"
[ -z "$SLOW_NODE" ] || COMMAND="SLOW_NODE=$SLOW_NODE SLOW_RATE=$SLOW_RATE $COMMAND"
COMMAND="sudo $COMMAND"
THREADS=$(( $(nproc) / NODES > 0 ? $(nproc) / NODES : 1 ))  # the nodes share this CPU
pids=()
for i in $(seq 0 $((NODES - 1))); do
    ip netns exec "${PREFIX}n$i" env GLOO_SOCKET_IFNAME=eth0 MINDDP_BENCH_THREADS=$THREADS \
        MINDDP_BENCH_COMMAND="$COMMAND" \
        "$PY" -m torch.distributed.run --nnodes="$NODES" --nproc_per_node=1 --node_rank="$i" \
        --master_addr="$SUBNET.1" --master_port="$PORT" \
        "$SCRIPT" --out "$OUT" "${ARGS[@]}" > "$OUT/node$i.log" 2>&1 &
    pids+=($!)
done
status=0
for i in "${!pids[@]}"; do
    wait "${pids[$i]}" || { status=$?; echo "multinode.sh: node $i failed (see $OUT/node$i.log)" >&2; }
done
grep -v "^\s*$" "$OUT/node0.log" | grep -v "\] [0-9]*/[0-9]* " || true
exit $status
