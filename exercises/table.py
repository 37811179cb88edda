"""The exercises, in the lecture's order: the one place that says which functions of the project
each exercise asks the student to write, the hint the stub carries, and how grade.py checks it.

An exercise names functions (or methods, "Class.method") of the real files; start.py copies the
files and replaces those bodies, grade.py runs the project's own checks on the copy. So when a
file changes, its exercise follows it, and retargeting an exercise is editing its entry here.

check: what grade.py runs (grade.py's CHECKS say what each kind does)
  ("collective", ops)            ops of collectives.py against torch.distributed's built-ins,
                                 odd sizes, at each world size, bytes to the formula
  ("train", module, flags)       the strategy's main() at each world size against the one-process
                                 ddp.py run: loss and gradient norm at every step, bytes to the
                                 file's own traffic_per_rank()
  ("schedule", name)             pipeline_parallel.simulate() of every rank's action list at
                                 several sizes: no deadlock, every micro-batch once (forward
                                 first), 1F1B's length (m + p - 1)(F + B) and its memory
  ("merge",)                     context_parallel.merge() of two halves against one softmax
  ("faults", spec)               fault_tolerance.py's launcher, 3 replicas, --faults=spec: who trained
                                 each step, loss and gradient norm against its one-process reference
worlds: the world sizes of the launches (a ring's wrong neighbour is invisible at 2: take 3 too).
"""
from collections import namedtuple

Exercise = namedtuple("Exercise", "name file functions teaches minutes hint checks worlds")

_STEPS = ("(sends, recvs, then) steps: sends and recvs are lists of (tensor, global rank); _run posts a "
          "step's messages together, waits for them, then calls then() (or nothing if None)")

EXERCISES = [
    Exercise(
        "tree_broadcast", "collectives.py", ["_tree_broadcast"],
        "a binomial tree: the ranks holding the data double each round, ceil(log2 N) rounds",
        20,
        "Return a list of " + _STEPS + ". Number the ranks from the root, v = (me - root) % n. In the round of "
        "mask = 1, 2, 4, ...: a rank with v < mask (it has the data) sends buf to v + mask if that is < n; a rank "
        "with mask <= v < 2*mask receives buf from v - mask. ranks[(root + v') % n] is the global rank of v'. "
        "Every rank but the root receives S once: (N-1)*S bytes in all.",
        [("collective", ["broadcast"])], (2, 3)),
    Exercise(
        "ring_reduce_scatter", "collectives.py", ["_ring_reduce_scatter"],
        "the ring: N-1 steps, each rank sends its partial sum right and adds what arrives from the left",
        40,
        "Return (steps, depth): a list of " + _STEPS + ", and how many steps _run may keep posted (1 is always "
        "safe). Cut src into n chunks with _pieces(src, n). In step s rank me sends its partial of chunk "
        "(me - s - 1) % n to `right` and receives the partial of chunk (me - s - 2) % n from `left` into a scratch "
        "tensor; then() adds it to its own part of that chunk: combine(a, b, out=o). After n-1 steps chunk me is "
        "the sum over all ranks. mine None: reduce in place in src (all_reduce); else src is only read, partials "
        "go through scratch and the result lands in mine. Each rank sends (N-1)/N*S: (N-1)*S bytes in all.",
        [("collective", ["reduce_scatter", "all_reduce"])], (2, 3)),
    Exercise(
        "ring_all_gather", "collectives.py", ["_ring_all_gather"],
        "the ring's second half: forward the chunk that just arrived, N-1 steps",
        20,
        "Return (steps, depth): a list of " + _STEPS + ", and how many steps _run may keep posted (1 is always "
        "safe). chunks[me] already holds this rank's part; the others must fill in place. In step s send chunk "
        "(me - s) % n to `right` and receive chunk (me - s - 1) % n from `left` straight into place: what arrived "
        "in step s is sent in step s + 1. Each rank sends (N-1)/N*S: (N-1)*S bytes in all.",
        [("collective", ["all_gather", "all_reduce"])], (2, 3)),
    Exercise(
        "pairwise_all_to_all", "collectives.py", ["_pairwise_exchange"],
        "all-to-all as N-1 pairwise exchanges: one partner each way per step, no link oversubscribed",
        15,
        "Return a list of " + _STEPS + ". send[j] is this rank's piece for group rank j, recv[j] where rank j's "
        "piece lands (recv[me] is already filled). In step k = 1 .. n-1 send send[(me + k) % n] to "
        "ranks[(me + k) % n] and receive recv[(me - k) % n] from ranks[(me - k) % n]: both ends of every message "
        "are in the same step. Bytes: every piece but your own, once.",
        [("collective", ["all_to_all"])], (2, 3)),
    Exercise(
        "ddp_naive", "ddp.py", ["all_reduce_each"],
        "data parallel: the mean gradient over the ranks, one all-reduce per parameter",
        10,
        "After backward every rank holds the gradient of its own slice of the batch in p.grad. The optimizer "
        "must see the mean over the global batch: C.all_reduce each p.grad with op='avg' on `group` (the sum "
        "would be N times too large: AdamW hides that in the loss, the gradient norm does not). Bytes: "
        "2(N-1)/N of the gradient bytes per rank.",
        [("train", "ddp", ["--bucket_mb=0", "--overlap=False"])], (2, 3)),
    Exercise(
        "ddp_buckets", "ddp.py", ["GradBuckets._ready", "GradBuckets.reduce"],
        "DDP's buckets: launch each bucket's all-reduce from backward's hooks, in the same order on every rank",
        30,
        "_ready(p) runs once p's gradient is complete. First self.claim(p) (its gradient into its bucket view, "
        "whatever the caller did to .grad). Do nothing more if not self.sync (a micro-step of gradient accumulation "
        "before the last: the sum is sent once). Count p in self.ready[self.bucket_of[p]]; then launch every bucket "
        "that is full, strictly in bucket order (self.launched is the next; self.launch() sends it: "
        "C.all_reduce(buffer, op='avg', group=self.group, async_op=True)). Every rank must issue its all-reduces in "
        "the same order, or the messages of two buckets meet. reduce(): overlap: launch, in order, the buckets the "
        "hooks did not (claim their members first: a parameter unused this step never fired), wait for every "
        "handle, then reset self.handles, self.ready and self.launched; bucketed: claim each bucket's members and "
        "all-reduce its buffer now, op='avg'.",
        [("train", "ddp", ["--bucket_mb=0.25", "--n_micro=2"]),
         ("train", "ddp", ["--overlap=False", "--bucket_mb=0.25"])],
        (2, 3)),
    Exercise(
        "zero1_step", "fsdp.py", ["train_step", "gather_full_weights"],
        "ZeRO-1: reduce-scatter the gradient, step on your shard, all-gather the weights",
        30,
        "train_step: zero every unit's u.grads and u.full_grad, run micro_step(net, x, y, 1/n) for each of the "
        "n = run.cfg.n_micro micro-batches (M.batch(run, it, 'train', m, n, run.rank, run.world)), summing "
        "the loss / n and taking the max of act. Stage 1 then reduce-scatters each unit's full gradient once, "
        "one unit at a time (u.finish_reduce(u.start_reduce()): the average over ranks replaces its gradient "
        "shard). -> (loss, act). gather_full_weights: every unit all-gathers its shards into its full buffers "
        "(u.gather()).",
        [("train", "fsdp", ["--zero_stage=1"])], (2, 3)),
    Exercise(
        "fsdp_unit", "fsdp.py", ["Unit.gather", "Unit.free", "Unit.reduce_scatter", "add_reduced"],
        "FSDP's unit: gather it before it computes, free it after, reduce-scatter its gradient",
        40,
        "Unit.gather: for each (full, shard) of self.full, self.shards: if full's storage is empty "
        "(full.untyped_storage().nbytes() == 0), give it back its memory (resize_ to numel * element_size); "
        "all-gather shard.to(full.dtype) into full on self.group (async_op as asked); tell self.live (if not "
        "None) with gathered(self); return the handles. Unit.free: tell self.live (freed(self)), then shrink each "
        "full buffer's storage to 0 bytes: the parameters are views into it, so their memory goes too. "
        "Unit.reduce_scatter(flats): for each flat gradient start C.reduce_scatter into a new tensor of "
        "numel/self.world with op='avg', async_op=True; return (self, [(out, g, handle), ...]). "
        "add_reduced(reducing, replace): None -> nothing; else wait for each handle and add out into the "
        "matching u.grads shard (copy instead of add if replace); then point each (piece, g) of u.held "
        "(if any) back at g: piece.grad = g.",
        [("train", "fsdp", ["--zero_stage=3"]), ("train", "fsdp", ["--zero_stage=2"])], (2, 3)),
    Exercise(
        "tp_f_and_g", "tensor_parallel.py", ["_CopyToParallelRegion.forward", "_CopyToParallelRegion.backward",
                                             "_ReduceFromParallelRegion.forward", "_ReduceFromParallelRegion.backward"],
        "tensor parallel's conjugate pair: f is identity forward and all-reduce backward, g the reverse",
        15,
        "f (_CopyToParallelRegion): forward keeps ctx.group and returns x; backward all-reduces the gradient "
        "(sum) over ctx.group, since each rank's dX came through its own slice of the weights -> (grad, None). "
        "g (_ReduceFromParallelRegion): forward all-reduces x (sum) over group, in place (ctx.mark_dirty(x)), "
        "and returns it; backward passes the gradient through -> (grad, None).",
        [("train", "tensor_parallel", [])], (2, 3)),
    Exercise(
        "tp_column_row", "tensor_parallel.py", ["ColumnParallelLinear.forward", "RowParallelLinear.forward"],
        "Megatron's MLP: a column-parallel layer then a row-parallel one, one all-reduce each way",
        15,
        "Column: Y_i = f(X) A_i + b_i: self.f(x, self.group), then F.linear with this rank's weight rows and "
        "bias. Row: the input is already split by features; Y = g(X_i A_i) + b: F.linear with this rank's weight "
        "columns and no bias, self.g(..., self.group) to sum over the ranks, then add the replicated bias once, "
        "after the sum (if there is one).",
        [("train", "tensor_parallel", [])], (2, 3)),
    Exercise(
        "tp_vocab_loss", "tensor_parallel.py", ["_VocabParallelCrossEntropy.forward",
                                                "_VocabParallelCrossEntropy.backward"],
        "the cross-entropy of logits split by vocabulary, from three all-reduces of n numbers",
        30,
        "forward(logits (n, V/N), target (n,), lo, group): m = the max logit over the whole vocabulary "
        "(all_reduce op='max'); z = logits - m; the target's z: only the rank with lo <= target < lo + V/N has it, "
        "the others add 0 (all_reduce sum); the sum of exp(z) over the whole vocabulary (all_reduce sum). loss = "
        "log(sum_exp) - z_target, per token. Save softmax = exp(z) / sum_exp and where the target is (and "
        "whether it is outside) for backward: d loss/d z = softmax - onehot(target), on this rank's columns only, "
        "times grad -> (dz, None, None, None).",
        [("train", "tensor_parallel", [])], (2, 3)),
    Exercise(
        "pp_1f1b", "pipeline_parallel.py", ["steps"],
        "the 1F1B schedule: a warm-up of forwards, then one forward one backward, then the cool-down",
        30,
        "Return rank r's computes as a list of steps, each a list of one Compute (F(chunk, micro) = "
        "Compute('F', r, k), B likewise); plan() adds the messages. Graded: name == '1f1b' (gpipe: every F then "
        "every B; others may raise ValueError). 1F1B: the gradient of micro-batch 0 comes back to rank r after "
        "p-1-r forwards (the warm-up, at most m); then alternate the next forward and the oldest backward; then "
        "the remaining backwards. Rank r then holds at most p - r micro-batches, and no exchange can deadlock.",
        [("schedule", "1f1b"), ("train", "pipeline_parallel", ["--schedule=1f1b", "--n_micro=4"])], (2, 3)),
    Exercise(
        "moe_dispatch_combine", "expert_parallel.py", ["ExpertParallelMoE.by_all_to_all", "transpose_blocks"],
        "expert parallelism: each token's row to its expert's rank and back, one all-to-all each way",
        40,
        "by_all_to_all: order = M.by_expert(chosen, keep) puts my kept choices by expert, so by the rank that "
        "holds it (row = order // k). kept (N, E) is the rows rank i brings expert e: per_rank = "
        "kept.view(N, N, self.local).sum(-1) is what rank i sends rank j; send = per_rank[me], recv = "
        "per_rank[:, me]; stats gets sent_tokens / received_tokens (without my own rows). dispatch the rows, "
        "run self.experts on them ordered by expert (transpose_blocks with this rank's (N, E/N) counts, and the "
        "rows per expert), put them back in rank order, combine, and M.scatter_choices(out, order, chosen.shape). "
        "transpose_blocks(x, counts): x is blocks of counts[i][j] rows, i-major -> the same blocks, j-major.",
        [("train", "expert_parallel", ["--model=tiny_moe", "--n_expert=4", "--top_k=2"])], (2,)),
    Exercise(
        "ring_attention_merge", "context_parallel.py", ["merge"],
        "ring attention: partial softmaxes over blocks of keys combine exactly, by their log-sum-exp",
        15,
        "In place: out, lse hold the attention over some keys (lse: each row's log-sum-exp of the scores), o, l "
        "over others. The attention over both is their mean weighted by each part's mass e^lse: new = "
        "logaddexp(lse, l); out = out * e^(lse - new) + o * e^(l - new); lse = new. Write into out and lse "
        "(they are views into the whole sequence's result): mul_, add_, copy_.",
        [("merge",), ("train", "context_parallel", ["--layout=zigzag"])], (2,)),
    Exercise(
        "ulysses_exchange", "context_parallel.py", ["seq_to_heads", "heads_to_seq"],
        "Ulysses: one all-to-all turns my positions of every head into every position of my heads, one turns it back",
        25,
        "seq_to_heads: cut x's heads (dim -3) into ring.n groups and stack them (group j goes to rank j); "
        "C.all_to_all_rows(send, group=ring.group) exchanges them, its backward included; part i of what arrives "
        "is rank i's positions of my heads: concatenate the parts along the positions (dim -2), in position "
        "order: under ring.layout == 'zigzag' part i holds chunks i and 2N-1-i of 2N, so the early halves "
        "first, then the late halves in reverse. heads_to_seq, the inverse: cut y's positions into the ranks' "
        "parts (zigzag: chunks i and 2N-1-i), stack them, all-to-all, and concatenate what arrives along the "
        "heads (dim -3). Bytes: (N-1)/N of each tensor, each way.",
        [("train", "context_parallel", ["--attention=ulysses", "--layout=zigzag"])], (2,)),
    Exercise(
        "quorum", "fault_tolerance.py", ["commit", "recover", "send_state"],
        "fault tolerance: a step commits on every survivor or on none; the survivors re-form; a joiner gets a peer's state",
        40,
        "commit: store.add the vote vote/{e}/{step}; wait_for next/{e}/{step} or abort/{e}; check next/ again after "
        "seeing abort/ (the coordinator may have written both); raise Failure if it is not there, else return "
        "int(store.get(next)). recover: compare_set abort/{e} to the time now if it is unset (the value it returns "
        "is when the fault was first noticed), dist.destroy_process_group() (a peer blocked on us fails at once), "
        "store.set alive/{e}/{me} to the step; return (e + 1, that time). send_state: nothing unless this epoch has "
        "joiners and you are its source or one of them; a joiner at step > 0 first makes AdamW's state (step, "
        "exp_avg, exp_avg_sq zeros; DiLoCo's momentum_buffer once step >= H); then one flat tensor, [step] + "
        "state_tensors(...), from the source to each joiner (C.send / C.recv, untracked, ranks are members.index(r)), "
        "copy_into the joiner's tensors; return its bytes (0 where nothing was sent).",
        [("faults", "1@2:reduce>4")], (2,)),
]

BY_NAME = {e.name: e for e in EXERCISES}
