#!/usr/bin/env bash
# Network namespaces and veth pairs for running gossip-switch without a NIC.
#
#   netns.sh up N dpdk|kernel [TAG]   create gsw<TAG>-sw (the switch) and gsw<TAG>-w0..N-1
#   netns.sh down [TAG]               remove everything netns.sh created for TAG
#
# Worker i lives in namespace gsw<TAG>-w<i> with interface gsw<TAG>-w<i>
# (10.77.<TAG>.<10+i>/24); its veth peer gsw<TAG>-s<i> sits in gsw<TAG>-sw.
#   dpdk:   the peers stay bare for net_af_packet vdevs; the switch answers ARP
#           for 10.77.<TAG>.1 and sends UDP checksum 0. Worker tx checksum
#           offload is off anyway (kernel packets on a veth carry a partial
#           checksum that af_packet hands over unfinished).
#   kernel: the peers are enslaved to bridge gsw<TAG>-br holding 10.77.<TAG>.1,
#           so a kernel-UDP aggregator in gsw<TAG>-sw sits in the switch's place.
# Only names starting with gsw<TAG>- are touched. Source it for gsw_up/gsw_down.
set -euo pipefail

gsw_names() {  # TAG → prefix and subnet
  GSW_TAG=${1:-0}
  GSW_P="gsw${GSW_TAG}"
  GSW_NET="10.77.${GSW_TAG}"
  GSW_IP="${GSW_NET}.1"
}

# A TAG is a number in 0..255 (an address byte, and part of every name).
gsw_tag_ok() {
  [[ $1 =~ ^(0|[1-9][0-9]{0,2})$ && $1 -le 255 ]] || { echo "netns.sh: TAG must be 0..255, not '$1'" >&2; return 2; }
}

gsw_down() {
  gsw_tag_ok "${1:-0}" || return 2
  gsw_names "${1:-0}"
  local ns
  # Names compared as text: gsw<TAG>-sw and gsw<TAG>-w<digits> only.
  for ns in $(ip netns list 2>/dev/null | awk -v p="${GSW_P}-" 'index($1, p) == 1 { r = substr($1, length(p) + 1); if (r == "sw" || r ~ /^w[0-9]+$/) print $1 }' || true); do
    ip netns del "$ns" 2>/dev/null || true
  done
}

gsw_up() {
  local n=$1 mode=$2
  # Checked before anything is made: addresses are 10.77.TAG.(10 + i).
  gsw_tag_ok "${3:-0}" || return 2
  [[ $n =~ ^[0-9]+$ && $n -ge 1 && $n -le 245 ]] || { echo "netns.sh: N must be 1..245 workers, not '$n'" >&2; return 2; }
  [[ $mode == dpdk || $mode == kernel ]] || { echo "netns.sh: the layout is dpdk or kernel, not '$mode'" >&2; return 2; }
  gsw_names "${3:-0}"
  gsw_down "$GSW_TAG"
  ip netns add "${GSW_P}-sw"
  ip -n "${GSW_P}-sw" link set lo up
  if [[ $mode == kernel ]]; then
    ip -n "${GSW_P}-sw" link add "${GSW_P}-br" type bridge
    ip -n "${GSW_P}-sw" addr add "${GSW_IP}/24" dev "${GSW_P}-br"
    ip -n "${GSW_P}-sw" link set "${GSW_P}-br" up
  fi
  local i
  for ((i = 0; i < n; i++)); do
    local ns="${GSW_P}-w$i"
    ip netns add "$ns"
    ip -n "$ns" link set lo up
    ip link add "${GSW_P}-w$i" type veth peer name "${GSW_P}-s$i"
    ip link set "${GSW_P}-w$i" netns "$ns"
    ip link set "${GSW_P}-s$i" netns "${GSW_P}-sw"
    ip -n "$ns" addr add "${GSW_NET}.$((10 + i))/24" dev "${GSW_P}-w$i"
    ip -n "$ns" link set "${GSW_P}-w$i" up
    ip -n "${GSW_P}-sw" link set "${GSW_P}-s$i" up
    # Big socket buffers are set per socket; the veth queue is deepened here.
    ip -n "$ns" link set "${GSW_P}-w$i" txqueuelen 10000
    if [[ $mode == kernel ]]; then
      ip -n "${GSW_P}-sw" link set "${GSW_P}-s$i" master "${GSW_P}-br"
    else
      ip netns exec "$ns" ethtool -K "${GSW_P}-w$i" tx off >/dev/null 2>&1 || true
      # No IPv6 chatter on the switch's ports.
      ip netns exec "${GSW_P}-sw" sysctl -qw "net.ipv6.conf.${GSW_P}-s$i.disable_ipv6=1" 2>/dev/null || true
    fi
  done
}

# The EAL/vdev arguments for gossip-switch on the dpdk layout of N workers.
gsw_vdevs() {
  local n=$1 i
  gsw_names "${2:-0}"
  for ((i = 0; i < n; i++)); do
    printf -- '--vdev=net_af_packet%d,iface=%s-s%d,framecnt=8192,qdisc_bypass=1 ' "$i" "$GSW_P" "$i"
  done
}

# Refuses to run where it cannot: prints why and returns 77 (meson's SKIP).
gsw_can_run() {
  if [[ $(id -u) != 0 ]]; then echo "SKIP: needs root for network namespaces"; return 77; fi
  if ! command -v ip >/dev/null; then echo "SKIP: iproute2 (ip) is not installed"; return 77; fi
  if ! ip netns add gsw-probe-$$ 2>/dev/null; then echo "SKIP: cannot create network namespaces here"; return 77; fi
  ip netns del gsw-probe-$$
}

if [[ ${BASH_SOURCE[0]} == "$0" ]]; then
  case "${1:-}" in
    up)  # a step that fails takes down what the earlier ones made (the arguments are checked first)
      gsw_tag=${4:-0}
      gsw_tag_ok "$gsw_tag" || exit 2
      [[ ${2:?N} =~ ^[0-9]+$ && $2 -ge 1 && $2 -le 245 ]] || { echo "netns.sh: N must be 1..245 workers, not '$2'" >&2; exit 2; }
      [[ ${3:?dpdk|kernel} == dpdk || $3 == kernel ]] || { echo "netns.sh: the layout is dpdk or kernel, not '$3'" >&2; exit 2; }
      set -E
      trap 'trap - ERR; gsw_down "$gsw_tag" 2>/dev/null || true' ERR
      gsw_up "$2" "$3" "$gsw_tag"
      trap - ERR ;;
    down) gsw_down "${2:-0}" ;;
    vdevs) gsw_vdevs "${2:?N}" "${3:-0}"; echo ;;
    *) echo "usage: $0 up N dpdk|kernel [TAG] | down [TAG] | vdevs N [TAG]" >&2; exit 2 ;;
  esac
fi
