#!/usr/bin/env bash
# hier_sync across nodes with torchrun: DDP inside each node, node models averaged across nodes in the background.
# Run the same command on every node, with its own NODE_RANK (0 on the node whose address is MASTER_ADDR):
#
#   NODE_RANK=0 MASTER_ADDR=head-node examples/multinode/torchrun.sh                    # on head-node
#   NODE_RANK=1 MASTER_ADDR=head-node examples/multinode/torchrun.sh                    # on the other node
#   NODE_RANK=0 MASTER_ADDR=head-node TRAINER=gpu NPROC_PER_NODE=4 examples/multinode/torchrun.sh trainer.max_epochs=3
#
# Arguments are passed on to syncasync-train as Hydra overrides (strategy.inter_period=8, strategy.compression=int8,
# experiment=lm, ...). Settings, from the environment:
#   NODE_RANK        this node's index, 0 .. NNODES-1 (required)
#   MASTER_ADDR      address of node 0, reachable from every node (required)
#   MASTER_PORT      rendezvous port on node 0 (default 29500). torch's TCPStore listens on all interfaces of that
#                    host with no authentication: keep the port on a private network
#   NNODES           number of nodes (default 2)
#   NPROC_PER_NODE   processes per node: GPUs per node, or CPU processes (default 2)
#   TRAINER          Hydra trainer preset: cpu (gloo) or gpu (NCCL, bf16-mixed) (default cpu)
#   RUN_DIR          output folder: results.json, checkpoints, logs (default outputs/multinode). Give every node the
#                    same folder on a shared file system: rank 0 writes the checkpoints that all ranks resume from
#   MAX_RESTARTS     torchrun --max-restarts (default 0). Above 0 the job resumes from RUN_DIR/checkpoints/last.ckpt
#   TORCHRUN         the torchrun command (default torchrun)
set -euo pipefail

: "${NODE_RANK:?set NODE_RANK: 0 on the node at MASTER_ADDR, 1..NNODES-1 on the others}"
: "${MASTER_ADDR:?set MASTER_ADDR to the address of node 0}"
MASTER_PORT=${MASTER_PORT:-29500}
NNODES=${NNODES:-2}
NPROC_PER_NODE=${NPROC_PER_NODE:-2}
TRAINER=${TRAINER:-cpu}
RUN_DIR=${RUN_DIR:-outputs/multinode}
MAX_RESTARTS=${MAX_RESTARTS:-0}
TORCHRUN=${TORCHRUN:-torchrun}

extra=()
if [ "$MAX_RESTARTS" -gt 0 ]; then
    # torch 2.13's torchrun shares its rendezvous store with the workers, and a restarted worker then reads the
    # previous attempt's gloo addresses (Connection refused; pytorch/pytorch#135712). Not sharing it is the way out;
    # syncasync-train warns when it is missing. A restarted attempt resumes from the fixed RUN_DIR's last checkpoint.
    export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1
    extra+=(ckpt_path=last)
fi

# $TORCHRUN unquoted on purpose: TORCHRUN="python -m torch.distributed.run" is split into its words.
# hydra.run.dir: a fixed folder, so every rank (each one a Hydra run of its own) writes to the same place and a
# restart finds the checkpoints; the default folder is named after each process's start time.
exec $TORCHRUN \
    --nnodes "$NNODES" \
    --node-rank "$NODE_RANK" \
    --nproc-per-node "$NPROC_PER_NODE" \
    --master-addr "$MASTER_ADDR" \
    --master-port "$MASTER_PORT" \
    --max-restarts "$MAX_RESTARTS" \
    -m lightning_syncasync.train \
    strategy=hier_sync \
    trainer="$TRAINER" \
    trainer.num_nodes="$NNODES" \
    trainer.devices="$NPROC_PER_NODE" \
    hydra.run.dir="$RUN_DIR" \
    ${extra[@]+"${extra[@]}"} \
    "$@"
