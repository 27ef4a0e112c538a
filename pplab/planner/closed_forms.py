"""The closed forms of the planner at scale (pplab.planner.at_scale): memory per GPU and step time
of a layout, written once for numpy arrays so that every layout of a cluster is evaluated at once.

* **compute** (chapter 10a): every operation of a layer on the roofline, max(FLOPs / (EFFICIENCY ×
  peak), bytes / HBM bandwidth): matrix products, attention (FlashAttention, fused, skips the masked
  half of a causal mask; "unfused" writes the scores), norms and element-wise ops. Backward = 2 ×
  forward; full recomputation runs the forward again, selective the attention again.
* **tensor parallelism** (chapter 3): 2 all-reduces of [b, s, h] a layer forward, 2 backward (with
  sequence parallelism, chapter 5: all-gathers and reduce-scatters of the same bytes), 2 more when
  recomputing; **context parallelism** (Llama 3's): an all-gather of K and V forward, the same
  again backward (a GPU keeps only its own tokens' K and V) and a reduce-scatter of their gradients;
  every collective by `pplab.cluster.predict_all_reduce`, with NVLink inside
  a node and the network between nodes (chapter 10b, with NETWORK_LATENCY a step between nodes),
  not overlapped with compute.
* **pipeline** (chapter 4), the heaviest rank's work per micro-batch t (its layers, the last stage's
  output layer) times m + (p−1)/v + (v−1)·max(0, p−m)/v: the 1F1B bubble (p−1)·t, shrunk v times by
  interleaving (Narayanan et al. 2021), larger when m < p (`pplab.pipeline.bubble_fraction`).
  Balanced (Llama 3's): the embedding and the output layer each take the place of one layer, so the
  first and last ranks hold one layer fewer (`stage_layers`).
* **data parallelism and ZeRO** (chapters 2 and 6): the gradients' all-reduce (reduce-scatter +
  all-gather for ZeRO-1/2, the same bytes) once a step (ZeRO-2 at its best: each rank keeps only its
  shard of the gradients, yet they are reduced once, not after every micro-batch); ZeRO-3 also all-gathers the weights twice
  and reduce-scatters each micro-batch; the optimizer step reads and writes its shard once.
* **memory per GPU** (the first pipeline rank: most micro-batches in flight, the embedding; with the
  balanced split the second rank when it holds more):
  parameters, gradients, Adam's state by `pplab.zero.model_state_bytes` over the ranks that hold the
  same weights: dp × cp for an expert's, dp × ep × cp for the rest (ep ranks read different data);
  activations by Korthikanti et al.'s per-layer count (`layer_activation_bytes`), times the layers
  the rank holds at its peak (`layers_in_flight`): its layers × min(p − rank, m) for 1F1B; for the
  interleaved schedule Megatron-LM's warm-up count, chunk by chunk.
* **attention** (FlashAttention) runs at its own fraction of peak, FLASH_UTILIZATION: a fused kernel of
  matrix products and a softmax does not reach what a plain matrix product does.
"""
from __future__ import annotations

import numpy as np

from ..cluster import Cluster, predict_all_reduce
from ..flops import attention, elementwise, layer_norm, matmul
from ..zero import model_state_bytes

# The efficiency of matrix products: the fraction of dense peak FLOP/s that a training step's matrix
# products sustain. Not fitted to any row; its justification is in notebooks/10_at_scale.ipynb.
EFFICIENCY = 0.6
# FlashAttention-2, the attention kernel of 2023-24, reaches about 35% of an H100's peak (Shah et al.
# 2024, "FlashAttention-3", whose kernel reaches 75%); a published figure, not fitted to any row.
FLASH_UTILIZATION = 0.35
# Latency of one step of a collective between nodes: "as high as tens of microseconds" on Llama 3's
# cluster ("The Llama 3 Herd of Models" §3.3.3); the low end, 10 µs. Inside a node it is left out.
NETWORK_LATENCY = 10e-6
ADAM_BYTES_TOUCHED = 28        # optimizer step per owned parameter: read + write fp32 master, m, v; read grad, write weight

# ----------------------------------------------------------------------------------
# Closed forms; every argument may be a numpy array (one entry per layout)

def layer_activation_bytes(model, micro_batch, tp=1, cp=1, sp=True, recompute="none"):
    """Bytes one layer keeps for backward, Korthikanti et al. 2022 (Table 2) for any transformer:
    16-bit activations, 1-byte dropout masks. Per token, with t = tp and sequence parallelism
    dividing the norms' and dropouts' share by t too:
        norms' inputs 2·2h; attention: its input 2h, q 2h/t, k and v 2·2·kv·d/t (a whole head when
        t > kv: each rank keeps a copy), its output 2h/t, (dropout mask h); scores: a·s/t × 5
        (softmax 2, its dropout mask 1 and output 2; 2 without dropout) unless fused or recomputed
        (selective); MLP: its input 2h, 2f/t (GeLU: its input and fc2's) or 3f/t (SwiGLU: gate, up
        and their product) × 2 bytes, (dropout mask h).
    For f = 4h and a·d = h that is s·b·h·(10 + 24/t + 5·a·s/(h·t)), or 34·s·b·h/t with sequence
    parallelism (pplab.memory.activation_bytes_formula). Full recomputation keeps the input only.
    cp splits the sequence: s/cp tokens a GPU, each attending to all s keys."""
    m, h, d = model, model.hidden, model.head_dim
    tp, cp, mb = np.asarray(tp), np.asarray(cp), np.asarray(micro_batch)
    shared = np.where(np.asarray(sp) & (tp > 1), tp, 1)          # what SP cuts: norms, dropouts, layer inputs
    tokens = mb * m.seq / cp
    drop = 1.0 if m.dropout else 0.0
    norms = 2 * 2 * h / shared
    attn = 2 * h / shared + (2 * h + 2 * h) / tp + 4 * kv_heads_per_rank(m, tp) * d + drop * h / shared
    mlp = 2 * h / shared + 2 * (3 if m.gated else 2) * m.f / tp + drop * h / shared
    scores = 0.0 if m.flash else (2 + 3 * drop) * m.heads * m.seq / tp    # per query token: a·s of each
    rec = np.asarray(recompute)
    per_token = norms + attn + mlp + np.where(rec == "none", scores, 0.0)
    return tokens * np.where(rec == "full", 2 * h / shared, per_token)


def kv_heads_per_rank(model, tp):
    """Key/value heads a tensor-parallel rank holds: kv/tp, or one copy when tp > kv (GQA)."""
    return np.maximum(model.kv / np.asarray(tp), 1)


def microbatches_in_flight(pp, m, v):
    """Micro-batches whose activations the first pipeline rank holds at its peak, in units of one
    micro-batch through all of its layers: 1F1B min(p, m); interleaved (v > 1) min(m, p + (p−1)/v)
    (Narayanan et al. 2021: the warm-up runs (v−1)·p + 2(p−1) chunk-forwards before the first backward)."""
    pp, m, v = np.asarray(pp), np.asarray(m), np.asarray(v)
    return np.where(v == 1, np.minimum(pp, m), np.minimum(m, pp + (pp - 1) / v))


def stage_layers(layers, pp, balanced):
    """(layers of the first rank, layers of the heaviest middle rank, layers of the last rank).
    Unbalanced: ceil(L/p) on the first, the last as many; balanced (Llama 3, "The Llama 3 Herd of
    Models" §3.3.2): the embedding and the output layer each fill one layer's slot, so with
    n = ceil((L+2)/p) slots a rank the first and last ranks hold n − 1 layers, the middle ones the rest."""
    L, pp, bal = layers, np.asarray(pp), np.asarray(balanced) & (np.asarray(pp) > 2)
    n = np.where(bal, np.ceil((L + 2) / pp), np.ceil(L / pp))
    edge = np.where(bal, n - 1, n)
    middle = np.where(bal, np.ceil((L - 2 * edge) / np.maximum(pp - 2, 1)), n)
    return edge, middle, edge


def layers_in_flight(pp, m, v, slots, balanced, rank=0):
    """Layer-micro-batches whose activations pipeline rank `rank` holds at its peak.
    1F1B: min(p − rank, m) micro-batches through its `slots` layers. Interleaved, v chunks of
    slots/v layers: Megatron-LM's warm-up runs 2(p−1−rank) + (v−1)·N chunk-forwards (N = p
    micro-batches a group, m if fewer; chunk 0 first), then one more forward before the first
    backward: W = min(m·v, (v−1)·N + 2(p−1−rank) + 1). Balanced, rank 0 (its first chunk holds the
    embedding in place of one layer): one layer fewer for each of the W that ran the first chunk."""
    pp, m, v = np.asarray(pp), np.asarray(m), np.asarray(v)
    n = np.minimum(pp, m)                                  # micro-batches a group (fewer when m < p)
    w = np.where(v == 1, np.minimum(pp - rank, m), np.minimum(m * v, (v - 1) * n + 2 * (pp - 1 - rank) + 1))
    first_chunk = np.where(v == 1, w, (w // (n * v)) * n + np.minimum(w % (n * v), n))
    light = np.where(np.asarray(balanced) & (pp > 2) & (rank == 0), 1, 0)
    return slots / v * w - light * first_chunk


def pipeline_steps(pp, m, v):
    """The step's length in units of the heaviest rank's work for one micro-batch (forward + backward):
    m + (p−1)/v, plus (v−1)·(p−m)/v when m < p (pplab.pipeline.bubble_fraction's cases)."""
    pp, m, v = np.asarray(pp), np.asarray(m), np.asarray(v)
    return m + (pp - 1) / v + (v - 1) * np.maximum(0, pp - m) / v


def _span(cluster, sizes, dims):
    """(nodes, GPUs per node) of a group over `dims`, ranks placed in the order tp, cp, pp, dp, ep
    innermost first (Llama 3's order): a dimension has min(size, g / stride) members in a node."""
    g, stride, per_node, total = cluster.gpus_per_node, 1, 1, 1
    for name in ("tp", "cp", "pp", "dp", "ep"):
        size = sizes[name]
        if name in dims:
            per_node = per_node * np.minimum(size, np.maximum(1, g // stride))
            total = total * size
        stride = stride * size
    return total // per_node, per_node


def _all_reduce(cluster, nbytes, nodes, per_node):
    """predict_all_reduce (hierarchical: ring in the node, ring across) for each layout's group."""
    hw = cluster.hardware
    intra, inter = (0.0, 1 / hw.nvlink), (NETWORK_LATENCY, 1 / hw.network)    # α inside a node left out
    nbytes, nodes, per_node = np.broadcast_arrays(np.asarray(nbytes, float), nodes, per_node)
    out = np.zeros(nbytes.shape)
    for n, r in set(zip(nodes.ravel().tolist(), per_node.ravel().tolist())):
        if n * r > 1:
            sel = (nodes == n) & (per_node == r)
            out[sel] = predict_all_reduce(nbytes[sel], Cluster(int(n), int(r)), intra, inter, "hierarchical")
    return out


def _heaviest_rank(t_layer, t_head, layers, pp, balanced):
    """Work of the slowest pipeline rank: whole layers, the last rank also the output layer, cut so
    that the slowest is as fast as it can be (k layers on the last rank, the rest spread evenly, no
    rank holding more than the ceil(L/p) that stage_layers, and so the memory, counts on the first);
    balanced: Llama 3's split (stage_layers)."""
    _, middle, last = stage_layers(layers, pp, balanced)
    balanced = np.asarray(balanced) & (pp > 2)
    best = np.where(pp == 1, layers * t_layer + t_head, np.inf)
    n = np.ceil(layers / pp)
    for k in range(0, -(-layers // int(np.min(pp))) + 1):
        rest = np.ceil((layers - k) / np.maximum(pp - 1, 1))
        ok = (pp > 1) & (k <= n) & (rest <= n)
        best = np.where(ok, np.minimum(best, np.maximum(k * t_layer + t_head, rest * t_layer)), best)
    return np.where(balanced, np.maximum(last * t_layer + t_head, middle * t_layer), best)


def evaluate(model, cluster, batch: int, x: dict) -> dict:
    """Memory (bytes per GPU) and time (seconds per step) of every layout in x (arrays of equal length)."""
    hw, M = cluster.hardware, model
    dp, tp, pp, cp, ep, zero, mb, v = (np.asarray(x[k]) for k in ("dp", "tp", "pp", "cp", "ep", "zero", "micro_batch", "v"))
    rec, sp = np.asarray(x["recompute"]), np.asarray(x["sp"]) & (tp > 1)
    bal = np.asarray(x["balanced"]) & (pp > 2)
    peak, bandwidth = hw.peak("bf16") * EFFICIENCY, hw.memory_bandwidth
    h, f, V, L = M.hidden, M.f, M.vocab, M.layers
    m = batch / (dp * ep * mb)                             # micro-batches per step (ep ranks read different data)
    T = mb * M.seq / cp                                    # tokens a GPU holds in one micro-batch
    shared = np.where(sp, tp, 1)
    up = 2 if M.gated else 1

    def seconds(op):                                       # the roofline: compute- or memory-bound
        return np.maximum(op.flops / peak, op.bytes / bandwidth)
    att = attention(mb, M.heads / tp, M.seq, M.head_dim, fused=M.flash)
    if M.flash:                                            # fused: skips the masked half, at its own utilization
        t_att = 0.5 * att.flops / (hw.peak("bf16") * FLASH_UTILIZATION) / cp
    else:
        t_att = seconds(att) / cp
    kv = kv_heads_per_rank(M, tp)
    t_fwd = (seconds(matmul(T, h, (M.heads / tp + 2 * kv) * M.head_dim)) + t_att
             + seconds(matmul(T, h, h / tp)) + M.top_k * (seconds(matmul(T, h, up * f / tp)) + seconds(matmul(T, f / tp, h)))
             + 2 * seconds(layer_norm(T / shared, h)) + 2 * seconds(elementwise(T * h / shared, 2))
             + M.top_k * seconds(elementwise(T * f / tp, up, 8)))
    t_layer = 3 * t_fwd + np.where(rec == "full", t_fwd, np.where(rec == "selective", t_att, 0.0))
    sizes = {"tp": tp, "cp": cp, "pp": pp, "dp": dp, "ep": ep}
    tp_ar = _all_reduce(cluster, mb * M.seq / cp * h * 2, *_span(cluster, sizes, {"tp"}))
    tp_calls = 4 + 2 * (rec == "full")                     # 2 forward, 2 backward, 2 more in the recomputed forward
    t_layer = t_layer + tp_calls * tp_ar
    kv_gather = _all_reduce(cluster, mb * M.seq * 2 * kv * M.head_dim * 2, *_span(cluster, sizes, {"cp"})) / 2
    # forward: all-gather K and V; backward: gather them again (only the local ones are kept, as
    # layer_activation_bytes counts) and reduce-scatter their gradients; full recomputation: a third gather
    t_layer = t_layer + (3 + (rec == "full")) * kv_gather
    if M.experts > 1:                                      # dispatch and combine, forward and backward
        t_layer = t_layer + 2 * _all_reduce(cluster, T * M.top_k * h * 2, *_span(cluster, sizes, {"ep"}))
    t_head = 3 * seconds(matmul(T, h, V / tp))
    hop = np.where(pp > 1, 2 * v * (NETWORK_LATENCY + T * h * 2 / tp / hw.network), 0.0)   # 1/tp of [b, s, h] a hop
    t_micro = _heaviest_rank(t_layer, t_head, L, pp, bal) + hop
    t_pipeline = t_micro * pipeline_steps(pp, m, v)

    # memory of the two ranks that can be heaviest: rank 0 (most in flight, the embedding) and, when
    # the split is balanced, rank 1 (two chunk-forwards fewer in flight, but a whole layer in every chunk).
    # Weights every rank of an ep group holds (attention, embedding) are replicated over dp·ep·cp ranks,
    # an expert's over dp·cp; ZeRO shards each over its replicas, the gradients are reduced over them.
    edge, middle, _ = stage_layers(L, pp, bal)
    shared_layer, expert_layer = M.attention_weights / tp, M.experts / ep * M.mlp_weights / tp
    layer_params = shared_layer + expert_layer
    zero_group, expert_group = dp * ep * cp, dp * cp

    def state_per_param(group):                                    # model state bytes per parameter
        out = np.zeros(np.shape(group))
        for stage, n in set(zip(zero.ravel().tolist(), np.ravel(group).tolist())):
            out[(zero == stage) & (group == n)] = model_state_bytes(int(stage), 1, int(n))
        return out
    per_param, per_expert_param = state_per_param(zero_group), state_per_param(expert_group)
    # while one layer is redone in backward, what its recomputation brings back: all of it (full), its
    # attention scores (selective: the rest is kept anyway)
    whole = layer_activation_bytes(M, mb, tp, cp, sp, "none")
    recomputed = np.where(rec == "full", whole, np.where(rec == "selective",
                                                         whole - layer_activation_bytes(M, mb, tp, cp, sp, "selective"), 0.0))
    per_layer = layer_activation_bytes(M, mb, tp, cp, sp, rec)
    psi0 = edge * layer_params + V * h / tp                        # rank 0: its layers + the embedding
    acts0 = per_layer * layers_in_flight(pp, m, v, np.where(bal, edge + 1, edge), bal, 0) + recomputed
    psi1 = middle * layer_params
    acts1 = np.where(pp > 2, per_layer * layers_in_flight(pp, m, v, middle, bal, 1) + recomputed, 0.0)
    experts0, experts1 = edge * expert_layer, middle * expert_layer        # of psi0, psi1: the experts' weights
    state0 = (psi0 - experts0) * per_param + experts0 * per_expert_param
    state1 = (psi1 - experts1) * per_param + experts1 * per_expert_param
    second = state1 + acts1 > state0 + acts0
    psi, acts = np.where(second, psi1, psi0), np.where(second, acts1, acts0)
    experts, state = np.where(second, experts1, experts0), np.where(second, state1, state0)
    shared = psi - experts

    def sharded(n_bytes, stages):                                  # bytes a rank keeps of n_bytes a parameter
        return (shared / np.where(stages, zero_group, 1) + experts / np.where(stages, expert_group, 1)) * n_bytes
    params, grads = sharded(2, zero == 3), sharded(2, zero >= 2)
    grad_ar = _all_reduce(cluster, psi * 2, *_span(cluster, sizes, {"dp", "cp"}))
    if np.any(ep > 1):                                             # two groups: shared weights, experts
        grad_ar = np.where(ep > 1, _all_reduce(cluster, shared * 2, *_span(cluster, sizes, {"dp", "ep", "cp"}))
                           + _all_reduce(cluster, experts * 2, *_span(cluster, sizes, {"dp", "cp"})), grad_ar)
    t_dp = np.where(zero == 3, 1.5 * m, 1.0) * grad_ar
    t_opt = sharded(ADAM_BYTES_TOUCHED, zero >= 1) / bandwidth
    total = t_pipeline + t_dp + t_opt
    return {"params": params, "grads": grads, "optimizer": state - params - grads, "activations": acts,
            "memory": state + acts, "compute": t_micro * m, "bubble": t_micro * (pipeline_steps(pp, m, v) - m),
            "tp": tp_ar * tp_calls * L / pp * m, "dp": t_dp, "optimizer_step": t_opt, "step": total}
# "compute" is the slowest rank's work over the step's m micro-batches (its collectives included),
# "bubble" what the pipeline adds to it, "tp" the tensor-parallel all-reduces of an average rank.
