#!/usr/bin/env bash
# The GPU-only checks of the repository, by name, each in its own time limit so one hang does not take
# the rest. Writes logs and JSON under $OUT (default: ./gpu-out). One device call is at most 10 minutes:
# pick the steps that fit, e.g.
#   bash benchmarks/gpu_checks.sh tests soak bubble        # one GPU, about 8 minutes on an H200
#   bash benchmarks/gpu_checks.sh tests pcie scaling-1.7b  # a machine with several GPUs
# Steps: tests tests-engine tests-compile soak bubble bubble-planners bubble-all bubble-all-db(f) moe throughput-mem pcie scaling-1.7b scaling-1.7b-db(f)
#        scaling-1.7b-mb4 scaling-4b ds-setup baselines-1.7b (after ds-setup, in the same call)
#        maxseq-1 maxseq-all maxseq-all-gm0.65 oom-snapshot     (-db: double_buffer='all', -dbf: 'first')
#        baselines-24gib baselines-24gib-zero (after ds-setup) baselines-4b baselines-4b-zero (after ds-setup)
#        baselines-4b-24gib baselines-4b-24gib-zero (after ds-setup) ds-wait (ds-setup's build finished)
#        maxseq24-zero2-probes (after ds-setup: ZeRO-2 at 81,920 and 65,536)
#        maxseq24-CONFIG (CONFIG: roundpipe fsdp-offload zero2-offload zero3-offload; 1.7B, 24 GiB card)
#        maxseq24-roundpipe-split baselines-split (roundpipe with each block as two layers: --split-blocks)
#        throughput-fused-2-3 (issue 3: fused stages of 2 and 3 blocks) throughput-gaps (3 blocks, idle gaps) hf-padded (the preset with a padding mask)
#        throughput-tail (issue 3: 3 and 2 fused blocks with the step's tail summed on the device)
#        lightning-user lightning-user-24gib lightning-user-long (issue 23: what a newcomer's Trainer code gets)
#        host-8b (issue 25) lora-gpt-oss lora-mistral (issue 26) sdpa loss-kernels kernel-experiments (issue 24: SDPA backends, LM-head losses, both under Trainer)
#        handoff (issue 24: the idle between all-fused batches after the loss moved before the backward)
#        kernels-off-4b-8b (issue 24: the 4B and 8B at 24 GiB without the kernels, one call)
#        cache-watch cache-watch-8b profile-24gib plain-liger-profile (issue 24: CacheWatch at 24 GiB, 1.7B and 8B;
#        the kept plan's profile; plain with Liger) host-bound host-bound-norm (issue 24: 2, 8 and 16 micro-batches,
#        one fused stage; torch's RMSNorm) mb-24gib (4 and 8 micro-batches at 24 GiB)
#        compile compile-loss-only compile-24gib (issue 24: regional torch.compile of the blocks, with and without
#        Liger's kernels inside them, full card; and at 24 GiB) defaults defaults-newcomer defaults-4b defaults-8b ab-24gib (issue 24:
#        compile="auto")
#        maxseq24-tiled-4x maxseq24-tiled-5x (one probe each: split blocks, --tile-tokens 16384, 24 GiB card)
#        varlen varlen-24gib (issue 39: instruction-like lengths 256..4096, 8 and 32 sequences a step, per-batch padding;
#        plain with Liger, with compiled blocks, packed; roundpipe's defaults) varlen-default (roundpipe's alone) varlen-expandable
#        varlen-shapes varlen-24gib-pool (issue 39: widths rounded up, flash first; 24 GiB with the pool's reuse)
#        varlen-8-shapes (issue 39: 8 a step: packed, one micro-batch, widths rounded) varlen-packed varlen-packed-24gib
#        (32 a step: packed, and flattened rows cut by roundpipe)
#        varlen-plain-packed (plain Lightning on packed rows) varlen-packed-8-24gib varlen-8-packed
#        varlen-24gib-gc (issue 39: the allocator's garbage collection against the reserve's creep at 24 GiB)
#        host-compiled (issue 39: the host step in one pass) onepass-24gib (that pass through Trainer)
#        auto-db-24gib (double_buffer="auto" against the defaults) memory-24gib memory-24gib-fixed (issue 39: the
#        24 GiB reserve held to the plan's limit: the cache given back after a batch above it, or the allocator capped)
#        varlen-8-ceiling (issue 39: 8 a step with SGD's lighter host step beside AdamW's)
#        defaults-8 defaults-rest (issue 39: optimizer_on="auto" the default) mirror (the masters' copy to the host)
#        bnb8 (bitsandbytes' AdamW8bit on the host and on the GPU, against torch's AdamW)
#        partial-24gib (issue 39: AdamW's math skipped on a share of the parameters, the plan sized for their states)
#        share-24gib (issue 39: optimizer_on=0.35 and 0.25, a share of the states on the GPU, against the defaults)
#        auto-share-24gib (issue 39: "auto" moving a share where the host bounds the step, against the defaults)
#        auto-share-default (the switch alone)
#        devopt-80gb (issue 39: an 80 GB card, every state moved by ShareSwitch.whole, the default, or the host;
#        -8 or -fixed: one half)
#        share-rest (issue 39: optimizer_on=0.3 at 24 GiB where the host does not bound the step: 32 a step, fixed)
#        varlen-8-devopt fixed-devopt (issue 39: optimizer_on="device" against the defaults) varlen-8-noop (no host math)
#        host-casts (issue 39: the host's cast and the GPU's beside the math; pinned by allocation or in place)
#        varlen-8-switch (issue 39: the interpreter's switch interval at 0.5 ms in training)
#        host-contention (issue 39: the host step's parts beside a step's other host work; blocking CUDA events)
#        reserve-24gib (issue 39: the allocator's reserve at 24 GiB by the stream that holds it)
#        uppool-24gib uppool-fixed (issue 39: the weights' buffers from compute's pool against the uploads' own;
#        UPPOOL_CONFIGS=... picks the configurations)
#        liger-profile (issue 41: plain-liger's speed)
#        headline headline-24gib headline-zero headline-zero-24gib (issue 41: the README's comparison; -zero after ds-setup
#        and ds-wait, in the same call or a later one on the warm machine)
#        qlora-70b qlora-8b tests-qlora (issue 40: bitsandbytes' wheel in .whl, installed with the others)
#        generic generic-24gib (issue 38: the 1.7B shape through the table's stages and the generic path in one call;
#        the Cohere and DeepSeek-V3 shapes, which take the generic path, at 24 GiB)
# At most 8 files come back from one device call: each step writes a log and, mostly, a JSON.
set -u
OUT=${OUT:-gpu-out}
mkdir -p "$OUT" && OUT=$(cd "$OUT" && pwd)  # absolute: a step may run from another tree (ab-24gib)
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1  # a caller's (carried wheels installed with --target) kept
GPUS=$(python -c "import torch; print(torch.cuda.device_count())")
run() {  # run NAME SECONDS COMMAND...
  local name=$1 limit=$2; shift 2
  echo "== $name"
  local start=$SECONDS
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
  echo "rc=$? wall_s=$((SECONDS - start))" >> "$OUT/$name.log"
  tail -n 8 "$OUT/$name.log"
}
maxseq() {  # maxseq WORKERS [GPU_MEMORY]: longest sequence of the 1.7B shape on cards capped at 8 GiB
  run "maxseq-$1${2:+-gm$2}" 290 python benchmarks/baselines.py --max-seq roundpipe --workers "$1" --gpu-gib 8 \
    --seq-len 16384 --seq-step 16384 --probe-timeout 100 --gpu-memory "${2:-0.8}" --out "$OUT/maxseq-$1${2:+-gm$2}.json"
}
steps=("$@")
[ ${#steps[@]} -eq 0 ] && steps=(tests soak bubble)
for step in "${steps[@]}"; do
  case $step in
    tests) run gpu-tests 420 python -m pytest -q -s -p no:cacheprovider -m gpu tests/ --ignore=tests/test_compile.py ;;
    tests-engine)  # the GPU tests of the engine's numerics and streams alone (the full list: tests), about 60 s
      run gpu-tests-engine 200 python -m pytest -q -s -p no:cacheprovider -m gpu tests/test_gpu.py -k "fp32 or \
        sharing or bf16 or async or optimizer_on_the_gpu or same_seed or out_of_memory or forward_only or tail \
        or lightning_on_gpu or edit_between" ;;
    tests-qlora) run gpu-tests-qlora 60 python -m pytest -q -s -p no:cacheprovider -m gpu tests/test_qlora.py ;;
    tests-compile)  # Inductor compiles of every dense family, about 25 s a test cold: 13 took just over 300 s (2026-12-03)
      run gpu-tests-compile 420 python -m pytest -q -s -p no:cacheprovider -m gpu tests/test_compile.py ;;
    soak) run soak 420 python benchmarks/soak.py --out "$OUT/soak.json" ;;
    bubble) run bubble 150 python benchmarks/bubble_check.py --steps 20 --out "$OUT/bubble.json" ;;
    bubble-planners)  # several GPUs: the automatic plan of each planner (measured 2026-11-30 on 2: about 80 s each)
      for planner in objective fastest; do
        run "bubble-$planner" 170 python benchmarks/bubble_check.py --devices "$GPUS" --seqs $((32 * GPUS)) \
          --microbatches $((8 * GPUS)) --steps 20 --planner "$planner" --out "$OUT/bubble-$planner.json"
      done ;;
    bubble-all) run bubble-all 150 python benchmarks/bubble_check.py --devices "$GPUS" --steps 20 \
      --timeline "$OUT/timeline-all.json" --out "$OUT/bubble-all.json" ;;
    bubble-all-db|bubble-all-dbf) buffering=$([ "$step" = bubble-all-db ] && echo all || echo first)
      run "$step" 150 python benchmarks/bubble_check.py --devices "$GPUS" --steps 20 --double-buffer "$buffering" \
      --timeline "$OUT/timeline-$step.json" --out "$OUT/$step.json" ;;
    scaling-1.7b-db|scaling-1.7b-dbf) buffering=$([ "$step" = scaling-1.7b-db ] && echo all || echo first)
      run "$step" 300 python benchmarks/scaling.py --models qwen3-1.7b --double-buffer "$buffering" \
      --out "$OUT/$step.json" ;;
    oom-snapshot) run oom-snapshot 150 python benchmarks/baselines.py --run roundpipe --workers "$GPUS" --seqs "$GPUS" \
      --micro-batch 1 --seq-len 32768 --warmup 3 --steps 1 --gpu-gib 8 --memory-snapshot "$OUT/oom.pickle"
      cat "$OUT/oom.txt" 2>/dev/null ;;
    moe) run moe-lora 480 python benchmarks/moe_lora.py --out "$OUT/moe-lora.json" ;;
    throughput-fused-2-3)  # issue 3: between 1 fused block (0.880 of plain, 0.185 of its memory) and 4 (0.905, 0.388)
      run throughput-fused-2 300 python benchmarks/throughput.py --configs plain,roundpipe-priority --fused-blocks 2 \
        --profile "$OUT/prof" --out "$OUT/throughput-fused-2.json"  # kernel and copy busy fractions: where the 10% goes
      run throughput-fused-3 200 python benchmarks/throughput.py --configs roundpipe-priority --fused-blocks 3 \
        --out "$OUT/throughput-fused-3.json"
      tar czf "$OUT/throughput-fused-profiles.tgz" -C "$OUT" prof && rm -rf "$OUT/prof" ;;  # one file back, not many
    throughput-gaps)  # issue 3: 3 fused blocks (0.894 of plain at 0.30 of its memory), where the device idles
      run throughput-gaps 420 python benchmarks/throughput.py --fused-blocks 3 \
        --configs plain,roundpipe-priority,roundpipe-priority@max_inflight=6 --out "$OUT/throughput-gaps.json" ;;
    throughput-tail)  # issue 3 after the stream-order fix of the device-side tail sum (measured 2026-12-01 before
      # it: 0.942 of plain at 0.299 of its memory with 3 fused blocks, 0.935 at 0.242 with 2; about 3 minutes)
      run throughput-tail-3 240 python benchmarks/throughput.py --fused-blocks 3 --configs plain,roundpipe-priority \
        --out "$OUT/throughput-tail-3.json"
      run throughput-tail-2 120 python benchmarks/throughput.py --fused-blocks 2 --configs roundpipe-priority \
        --optimizer-steps 0 --out "$OUT/throughput-tail-2.json" ;;
    lightning-user)  # issue 23: a Hugging Face model under Trainer, as a newcomer writes it, against plain and hand-tuned
      run lightning-user 560 python benchmarks/lightning_user.py --configs plain,newcomer,tuned-4,tuned-2 \
        --config-timeout 170 --out "$OUT/lightning-user.json" ;;
    lightning-user-24gib) run lightning-user-24gib 400 python benchmarks/lightning_user.py --gpu-gib 24 \
        --configs newcomer,tuned-4,tuned-8 --config-timeout 150 --out "$OUT/lightning-user-24gib.json" ;;
    host-8b)  # issue 25: the 8B shape in bf16-true at 24 GiB, synchronous, with the host timeline (about 210 s).
      # The compiling first batch moves the plan to batch 9: 10 warm-up steps keep it out of the timed ones
      run host-8b 320 python benchmarks/lightning_user.py --model qwen3-8b --precision bf16-true --gpu-gib 24 \
        --configs newcomer-sync --warmup 10 --config-timeout 310 --out "$OUT/host-8b.json" ;;
    lora-gpt-oss|lora-mistral)  # issue 26: LoRA through Trainer at 24 GiB (gpt-oss-20b, mistral-7b)
      shape=$([ "$step" = lora-gpt-oss ] && echo gpt-oss-20b || echo mistral-7b)
      run "$step" 240 python benchmarks/moe_lora.py --shape "$shape" --out "$OUT/$step.json" ;;
    sdpa) run sdpa 60 python benchmarks/sdpa_backends.py --out "$OUT/sdpa.json" ;;
    loss-kernels) run loss-kernels 90 python benchmarks/loss_kernels.py --out "$OUT/loss-kernels.json" ;;
    kernel-experiments)  # issue 24: cuDNN attention first, through Trainer (Liger's cross-entropy in 2,048-token
      # chunks, measured here on 2026-12-02 as newcomer-flce2048 at 1.037x, is the default since)
      run kernel-experiments 230 python benchmarks/lightning_user.py --configs newcomer,newcomer-cudnn \
        --config-timeout 105 --out "$OUT/kernel-experiments.json" ;;
    handoff)  # issue 24: the loss down before the fused backward (1a40362): the step boundary's idle, full card
      # (predicted about 50k tokens/s against 46.6-47.1k) and the 24 GiB card (35,488 before); about 230 s
      run handoff 120 python benchmarks/lightning_user.py --configs newcomer --profile --profile-steps 2 \
        --config-timeout 110 --out "$OUT/handoff.json"
      # 24 GiB: the simulator predicted 1.41 s per step for its plan, 1.85 were measured: where does it go
      run handoff-24gib 130 python benchmarks/lightning_user.py --gpu-gib 24 --configs newcomer --profile \
        --profile-steps 2 --config-timeout 120 --out "$OUT/handoff-24gib.json" ;;
    cache-watch)  # issue 24, CacheWatch: at 24 GiB the default plan freed cached memory 460 times in six steps
      # (34,701 tokens/s), gpu_memory=0.6 none (37,505). The watch tries a plan for 0.75x the memory after four
      # settled freeing intervals, times it, times the first plan again and keeps the smaller one when it was
      # faster: about step 22, inside the 26 warm-up steps. About 260 s
      run cache-watch 340 python benchmarks/lightning_user.py --gpu-gib 24 --configs newcomer,newcomer-gm0.6 \
        --warmup 26 --config-timeout 170 --out "$OUT/cache-watch.json" ;;
    cache-watch-8b)  # the 8B shape, bf16-true, 24 GiB: frees on every plan, and smaller ones ran slower (7,614
      # tokens/s after three lowerings): the trial should leave the first plan (about step 22). About 300 s
      run cache-watch-8b 380 python benchmarks/lightning_user.py --model qwen3-8b --precision bf16-true --gpu-gib 24 \
        --configs newcomer --warmup 24 --config-timeout 350 --out "$OUT/cache-watch-8b.json" ;;
    profile-24gib)  # issue 24's 40k at 24 GiB: the plan CacheWatch keeps (gpu_memory=0.6, no trial in the way) ran
      # 1.71 s per step against the planner's 1.40; where the other 0.3 s goes (kernel kinds, idle gaps). About 150 s
      run profile-24gib 240 python benchmarks/lightning_user.py --gpu-gib 24 --configs newcomer-gm0.6 --profile \
        --profile-steps 2 --warmup 8 --config-timeout 200 --out "$OUT/profile-24gib.json" ;;
    host-bound)  # issue 24: small micro-batches, one fused stage, full card. On 2026-12-02 (sixth session) 16
      # micro-batches of 2 sequences ran 24,096 tokens/s against 49k for 2 of 16: py-spy had the worker's thread
      # (forward) and autograd's (backward) busy in turn; the blocks now share the attention inputs. About 250 s
      run host-bound 360 python benchmarks/lightning_user.py --configs fused-2,fused-8,fused-16 --warmup 6 --steps 4 --profile \
        --config-timeout 110 --out "$OUT/host-bound.json" ;;  # the profile: kernel seconds against the span
    host-bound-norm)  # the same with torch's RMSNorm (--norm torch: one C++ launch each way instead of
      # liger-kernel's Python path, a quarter of a block's host time at 16 micro-batches); newcomer first: at 2
      # micro-batches Liger's kernel was chosen for its device time. About 230 s
      run host-bound-norm 300 python benchmarks/lightning_user.py --configs newcomer,fused-16 --norm torch \
        --warmup 6 --steps 4 --config-timeout 120 --out "$OUT/host-bound-norm.json" ;;
    mb-24gib)  # issue 24's 40k at 24 GiB: more micro-batches let the fused stage hold blocks (less recompute);
      # the planner ranks 4 micro-batches 10% slower than 2, unmeasured since kernels came (2026-12-01 without
      # them: 4 ran 1.016x the chosen 2). gpu_memory=0.6 so the allocator does not free. About 300 s
      run mb-24gib 380 python benchmarks/lightning_user.py --gpu-gib 24 --configs newcomer-gm0.6,tuned-4-gm0.6,tuned-8-gm0.6 \
        --warmup 10 --steps 6 --config-timeout 125 --out "$OUT/mb-24gib.json" ;;
    compile)  # issue 24: compile=True (each block through torch.compile) against eager blocks, one fused stage,
      # full card. Predicted: fused-16-compile well above fused-16 (24.1k on 2026-12-02: host-bound, about 5 ms
      # per block and micro-batch), toward fused-2's 49k; fused-2-compile within 5% of fused-2 (device-bound
      # there, Liger's kernels against Inductor's). Warmup 8: the first batches compile. About 420 s
      run compile 560 python benchmarks/lightning_user.py --configs fused-16,fused-16-compile,fused-2-compile,fused-2 \
        --warmup 8 --steps 4 --config-timeout 150 --out "$OUT/compile.json" ;;
    compile-loss-only)  # compiled blocks without Liger's kernels in them (--block-kernels none: Inductor fuses the
      # norms, SwiGLU and rotary itself; the output stage keeps Liger's fused cross-entropy). About 300 s
      run compile-loss-only 400 python benchmarks/lightning_user.py --configs fused-16-compile,fused-2-compile \
        --block-kernels none --warmup 8 --steps 4 --config-timeout 150 --out "$OUT/compile-loss-only.json" ;;
    defaults)  # issue 24 with compile="auto" the default (compiled blocks, Liger's loss only), side by side with
      # plain Lightning given Liger's kernels and given compiled blocks; then the 24 GiB card through its watch.
      # Predicted from the same settings under CONFIG-compile (2026-12-02, eighth session): about 51.0k full
      # card, 40.5k at 24 GiB (the watch keeps its 0.75x plan about step 21). About 330 s
      run defaults 330 python benchmarks/lightning_user.py --configs plain-liger,plain-compile,newcomer \
        --warmup 10 --steps 6 --config-timeout 130 --out "$OUT/defaults.json"
      run defaults-24gib 150 python benchmarks/lightning_user.py --gpu-gib 24 --configs newcomer --warmup 26 --steps 6 \
        --config-timeout 140 --out "$OUT/defaults-24gib.json" ;;
    defaults-newcomer)  # the default alone, full card then 24 GiB (after a change to the compiled path). About 280 s
      run defaults-newcomer 140 python benchmarks/lightning_user.py --configs newcomer --warmup 10 --steps 6 \
        --config-timeout 130 --out "$OUT/defaults-newcomer.json"
      run defaults-24gib 150 python benchmarks/lightning_user.py --gpu-gib 24 --configs newcomer --warmup 26 --steps 6 \
        --config-timeout 140 --out "$OUT/defaults-24gib.json" ;;
    varlen)  # issue 39: full card, 8 then 32 sequences of 256..4096 tokens a step. About 500 s
      run varlen-8 280 python benchmarks/lightning_user.py --varlen 256,4096 --seqs 8 --micro-batch 8 \
        --configs plain-liger,plain-compile,plain-compile-packed,newcomer --warmup 10 --steps 6 --config-timeout 90 \
        --out "$OUT/varlen-8.json"
      run varlen-32 300 python benchmarks/lightning_user.py --varlen 256,4096 --seqs 32 --micro-batch 8 \
        --configs plain-compile,newcomer --warmup 10 --steps 4 --config-timeout 140 --out "$OUT/varlen-32.json" ;;
    varlen-24gib)  # issue 39: the default at 24 GiB on the same data. About 300 s
      run varlen-24gib 300 python benchmarks/lightning_user.py --varlen 256,4096 --seqs 8 --gpu-gib 24 \
        --configs newcomer --warmup 26 --steps 6 --config-timeout 140 --out "$OUT/varlen-24gib.json"
      run varlen-24gib-32 300 python benchmarks/lightning_user.py --varlen 256,4096 --seqs 32 --gpu-gib 24 \
        --configs newcomer --warmup 12 --steps 4 --config-timeout 280 --out "$OUT/varlen-24gib-32.json" ;;
    varlen-default)  # issue 39 (plans in tokens): the default alone on the varlen data, 32 sequences a step on the full
      # card and at 24 GiB, 8 on the full card. About 550 s (the first version's measuring batches took longer: the
      # padding mask's cost, gone in fb11b3d)
      vl=(python benchmarks/lightning_user.py --varlen 256,4096 --configs newcomer)
      run varlen-32-default 210 "${vl[@]}" --seqs 32 --warmup 10 --steps 4 --config-timeout 200 \
        --out "$OUT/varlen-32-default.json"
      run varlen-32-24gib 220 "${vl[@]}" --seqs 32 --gpu-gib 24 --warmup 14 --steps 4 --config-timeout 210 \
        --out "$OUT/varlen-32-24gib.json"
      run varlen-8-default 150 "${vl[@]}" --seqs 8 --warmup 10 --steps 6 --config-timeout 140 \
        --out "$OUT/varlen-8-default.json" ;;
    host-contention)  # issue 39, 8 a step host-bound (2026-12-04, seventeenth: the optimizer thread's math and cast took
      # 0.53 + 0.21 s a step in training, 0.34 + 0.12 s alone): the parts beside each load a step puts next to
      # them (about 90 s), then the defaults against blocking CUDA events, with the optimizer thread's trace (about 230 s),
      # then the defaults with OpenMP's idle threads sleeping instead of spinning (about 110 s)
      run host-step 150 python benchmarks/host_step.py --out "$OUT/host-step.json" \
        --only math,cast,math-then-cast,math-then-cast+spinners,math-then-cast+sleepers,math-then-cast+dma,math-then-cast+python,device-cast,math-beside-device-cast,math-beside-upload
      run varlen-8-blocking 300 python benchmarks/lightning_user.py --varlen 256,4096 --seqs 8 \
        --configs newcomer,newcomer-blocking --warmup 10 --steps 8 --host-trace --config-timeout 140 \
        --out "$OUT/varlen-8-blocking.json"
      OMP_WAIT_POLICY=PASSIVE run varlen-8-omp-passive 150 python benchmarks/lightning_user.py --varlen 256,4096 --seqs 8 \
        --configs newcomer --warmup 10 --steps 8 --host-trace --config-timeout 140 --out "$OUT/varlen-8-omp-passive.json" ;;
    host-casts)  # issue 39: math, the host's cast and the GPU's (device-cast), alone and beside the math, then math and
      # cast with the compute copies pinned by allocation (0.34 + 0.12 s on 2026-12-03's lease against 0.41 + 0.15
      # registered on 2026-12-04's), then math and cast beside a Python thread with a tenth of the default switch
      # interval (1.79 s at the default: expected near 0.6 s if the GIL's hand-back was the cost): under 230 s
      run host-casts 100 python benchmarks/host_step.py --out "$OUT/host-casts.json" \
        --only math,cast,math-then-cast,device-cast,math-beside-device-cast
      run host-allocated 70 python benchmarks/host_step.py --pin allocated --only math,cast \
        --out "$OUT/host-allocated.json"
      run host-switch 80 python benchmarks/host_step.py --switch-interval 0.0005 \
        --only math-then-cast,math-then-cast+python --out "$OUT/host-switch.json" ;;
    varlen-8-switch)  # issue 39: 8 a step with the interpreter's switch interval at 0.5 ms against the default 5 ms, the
      # optimizer thread traced (about 160 s): worth it only if host-switch showed the GIL's hand-back costing
      run varlen-8-switch 200 python benchmarks/lightning_user.py --varlen 256,4096 --seqs 8 \
        --configs newcomer,newcomer-switch500 --warmup 10 --steps 8 --host-trace --config-timeout 130 \
        --out "$OUT/varlen-8-switch.json" ;;
    host-compiled)  # issue 39: the host step's math and cast in one pass (30 bytes a parameter instead of 34). On one
      # H200 (2026-12-07, thirtieth): 0.494 s against 0.676 for the two passes, in this script's first form of the
      # kernel. `native` is the engine's kernel since 2026-12-08 (C++ through ctypes, which lets go of the GIL;
      # runtime/one_pass.py), `compiled` Inductor's form of the same arithmetic (the engine's before; its build timed
      # apart, `compiled-build`, about 75 s with a cold Inductor cache). Expected both near 0.5 s, math-then-cast near
      # 0.68. python_share: a Python thread's pace beside each (torch's operators and the C++ kernel let go of the
      # GIL, Inductor's kernels hold it): expected about 0.5 beside math-then-cast and native, under 0.1 beside
      # compiled. On the CPU machine (--scale 0.1 --blocks 6) native 0.077 s, compiled 0.102, math-then-cast 0.129.
      # About 160 s
      run host-compiled 400 python benchmarks/host_step.py \
        --only math,cast,math-then-cast,compiled,compiled-math,compiled-cast,native \
        --out "$OUT/host-compiled.json" ;;
    onepass-24gib)  # issue 39 at 24 GiB, 8 a step: double_buffer="all" with AdamW's math and cast in one compiled pass
      # (runtime/one_pass.py) against the same spares with torch's AdamW and a separate cast, and the defaults. The
      # H200's defaults waited 0.40 s a batch for the host's update of a 0.8 s step (2026-12-07); the kernel took 0.18 s
      # off the host's step alone. Expected: newcomer-db near 27-29k real tokens/s, twopass near the defaults' 23k;
      # one_pass.off_because null in the JSON. About 330 s
      run onepass-24gib 420 python benchmarks/lightning_user.py --varlen 256,4096 --seqs 8 --gpu-gib 24 \
        --configs newcomer-db,newcomer-db-twopass,newcomer --warmup 20 --steps 6 --config-timeout 200 \
        --out "$OUT/onepass-24gib.json" ;;
    auto-db-24gib)  # issue 39 at 24 GiB, 8 a step: double_buffer="auto" (spares where the host holds them, so AdamW's
      # math and cast run in one pass; a candidate default) against the defaults (no spares: 23,295 real tokens/s on
      # the H200 on 2026-12-07; 22,041 on an H100). newcomer-dbauto: double_buffer "all", one_pass.off_because null,
      # one_pass.groups_updated above 0 (30 groups an update).
      # First run 2026-12-07 (32nd), on an H100, with Inductor's kernel compiled serially: 5,410 real tokens/s (its
      # host math 2.8 s a step) against the defaults' 22,041. Since 2026-12-08 the kernel is C++ through ctypes, which
      # lets go of the GIL (Inductor's held it: the workers launched nothing while it ran). Expected: newcomer-dbauto
      # 27-29k (the host step about 0.5 s instead of 0.68), the defaults 22-23k. If so, make double_buffer="auto" the
      # default. About 300 s
      run auto-db-24gib 480 python benchmarks/lightning_user.py --varlen 256,4096 --seqs 8 --gpu-gib 24 \
        --configs newcomer-dbauto,newcomer --warmup 20 --steps 6 --config-timeout 200 \
        --out "$OUT/auto-db-24gib.json" ;;
    varlen-8-devopt)  # issue 39: 8 a step, RoundPipeStrategy(optimizer_on="device") (the training states on the GPU),
      # the defaults, and plain with compiled blocks, one call. Expected: the device optimizer bound by the devices,
      # 35-45k real tokens/s (SGD's 0.5 s host step gave 30,074; the devices' own step about 0.32 s), its losses equal
      # to the defaults' to bf16 rounding (the same order), NVML about 34 GB above the defaults' 49.5; the defaults
      # 23-25k. About 330-420 s
      # (a call's first configuration builds Inductor's and Triton's caches: 130-150 s were too short twice on
      # 2026-12-04, so 170 s each, and this step alone in its call)
      run varlen-8-devopt 540 python benchmarks/lightning_user.py --varlen 256,4096 --seqs 8 \
        --configs newcomer-devopt,newcomer,plain-compile --warmup 10 --steps 8 --host-trace \
        --config-timeout 170 --out "$OUT/varlen-8-devopt.json" ;;
    defaults-8)  # issue 39 with optimizer_on="auto" the default (the states on the GPU where they take at most half of
      # gpu_memory): every default at 8 a step against plain's best with per-batch padding (compiled blocks, Liger) and
      # plain with packing (flattened rows, compiled blocks). Expected: the defaults 40-43k real tokens/s (as
      # newcomer-devopt's 42,404), the log saying "on the GPU"; plain 11-14k; the ratio above 2.8. About 400 s
      run defaults-8 590 python benchmarks/lightning_user.py --varlen 256,4096 --seqs 8 \
        --configs newcomer,plain-compile,plain-liger,plain-compile-packed --warmup 10 --steps 8 --config-timeout 140 \
        --out "$OUT/defaults-8.json" ;;
    mirror)  # issue 39: each update's fp32 masters copied to the host's (2026-12-07, so the module's weights move
      # during training) against no copy, every default otherwise, 8 a step on the full card. Expected within 2% of
      # each other (6.9 GB a step over the otherwise idle device-to-host link, about 0.14 s beside a 0.41 s step)
      run mirror 330 python benchmarks/lightning_user.py --varlen 256,4096 --seqs 8 \
        --configs newcomer,newcomer-nomirror --warmup 10 --steps 8 --config-timeout 150 --out "$OUT/mirror.json" ;;
    bnb8)  # bitsandbytes' AdamW8bit, as QLoRA recipes write it, on a full fine-tune at 8 a step: every default (the
      # host, its CPU kernels) against its states on the GPU (its CUDA kernels, a device sync per parameter) and
      # torch's AdamW with every default. Expected: the host far slower (its CPU step took 15x torch's fused AdamW on
      # the CPU machine); the device within 20% of AdamW's if its per-parameter syncs overlap. About 450 s
      run bnb8 590 python benchmarks/lightning_user.py --varlen 256,4096 --seqs 8 \
        --configs newcomer-bnb8-device,newcomer,newcomer-bnb8 --warmup 10 --steps 6 --config-timeout 180 \
        --out "$OUT/bnb8.json" ;;
    partial-24gib)  # issue 39 at 24 GiB, 8 a step, before building partial residency (part of the states on the GPU):
      # AdamW's math skipped on the deepest 20% and 35% of the parameters (newcomer-skipF), the plan sized for what
      # that share's states would leave (20 bytes a parameter: 6.4 and 11.2 GiB of the 19.2), against the defaults.
      # Expected (the fit 0.41 s + 0.88 x the host step, if the smaller plans keep the devices' time): defaults 15-21k,
      # skip0.2 21-23k, skip0.35 22-25k real tokens/s; well under that says the smaller plans cost more than the
      # host saves, and partial residency is not the way. About 480 s
      run partial-24gib 590 python benchmarks/lightning_user.py --varlen 256,4096 --seqs 8 --gpu-gib 24 \
        --configs newcomer-skip0.35-gm0.333,newcomer-skip0.2-gm0.533,newcomer --warmup 20 --steps 6 \
        --config-timeout 185 --host-trace --out "$OUT/partial-24gib.json" ;;
    share-24gib)  # issue 39 at 24 GiB, 8 a step: optimizer_on=0.35 and 0.25 (that share's states on the GPU, the rest on
      # the host) against the defaults, one call. newcomer-skip0.35-gm0.333 gave 21,664 against 18,447 on one H100
      # (2026-12-07): the real thing also drops that share's casts, uploads and gradient downloads. Expected: the
      # shares 1.15-1.35x the defaults; NVML within 24 GiB (the states are fixed allocations beside the plan's
      # reserve, which at 8 GiB of plan rose to 13 GiB in the experiment). About 400 s
      run share-24gib 590 python benchmarks/lightning_user.py --varlen 256,4096 --seqs 8 --gpu-gib 24 \
        --configs newcomer-share0.35,newcomer-share0.25,newcomer --warmup 20 --steps 6 --config-timeout 185 \
        --host-trace --out "$OUT/share-24gib.json" ;;
    auto-share-24gib)  # issue 39 at 24 GiB, 8 a step: newcomer-autoshare (ShareSwitch.automatic on in its process:
      # "auto" moves a share of the states to the GPU once the host's step bounds the step) against every default (the
      # states on the host; the switch is off by default). Hand-set shares of 0.25-0.35 ran 1.12-1.13x. Expected: the switch near step 10, kept, about 0.3 (half of the 19.2 GiB limit); 1.15-1.35x the host
      # (newcomer-skip0.35-gm0.333 gave 1.17x on one H100); NVML within 24 GiB. About 300 s
      run auto-share-24gib 380 python benchmarks/lightning_user.py --varlen 256,4096 --seqs 8 --gpu-gib 24 \
        --configs newcomer-autoshare,newcomer --warmup 26 --steps 6 --config-timeout 185 --out "$OUT/auto-share-24gib.json" ;;
    auto-share-default)  # auto-share-24gib's switch alone (a short device budget): its pace and share_weighed.
      # Expected with 655d099's trigger (the worker's waits for the host, 0.34 s a batch against about 0.55 s of
      # compute): the share moved near step 11, about 0.3, judged near step 20; kept at 1.1-1.3x the 19.1k. About 110 s
      run auto-share-default 190 python benchmarks/lightning_user.py --varlen 256,4096 --seqs 8 --gpu-gib 24 \
        --configs newcomer-autoshare --warmup 26 --steps 6 --config-timeout 180 --out "$OUT/auto-share-default.json" ;;
    devopt-80gb|devopt-80gb-8|devopt-80gb-fixed)  # issue 39 on an 80 GB card (the H100s this week), full card:
      # "auto" kept the states on the host there until ShareSwitch.whole (on since 2026-12-07), since their 32 GiB
      # (20 bytes a parameter) are just over half of gpu_memory (31.7 GiB); the host then bounds the step at 8 a step (22,203 real tokens/s; every state on the
      # GPU by hand, newcomer-devopt, 33,349). The whole switch moves them once the first plan settled (step 12, an 11 s
      # step, over the pace's window; from 2026-12-07 over two intervals: expected two steps sooner) where the workers
      # wait for the host. Expected: newcomer 1.4x newcomer-nowhole or more over steps 17-24,
      # NVML under 64 GiB (the old engine's cache given back first); share_switch's seconds say where the move's 11 s
      # go; fixed 32 x 2048: nothing moved, within 2% of newcomer-nowhole. About 480 s
      # On an H200 the card is capped at 80 GiB (--gpu-gib), which is what an H100 80GB gives the plan.
      cap=$(python -c "import torch; print(80 if torch.cuda.get_device_properties(0).total_memory > 100 * 2**30 else '')")
      [ "$step" != devopt-80gb-fixed ] && run devopt-80gb-8 330 python benchmarks/lightning_user.py --varlen 256,4096 \
        --seqs 8 ${cap:+--gpu-gib $cap} --configs newcomer-nowhole,newcomer --warmup 16 --steps 8 --config-timeout 140 \
        --out "$OUT/devopt-80gb-8.json"
      [ "$step" != devopt-80gb-8 ] && run devopt-80gb-fixed 240 python benchmarks/lightning_user.py ${cap:+--gpu-gib $cap} \
        --configs newcomer-nowhole,newcomer --warmup 8 --steps 6 --config-timeout 110 --out "$OUT/devopt-80gb-fixed.json" ;;
    share-rest)  # issue 39: a share's cost where the host does not bound the step, 24 GiB: 32 a step of the varlen
      # data (the defaults 40,676 on the H200) and fixed 32 x 2048 (39-40k), optimizer_on=0.3 (about half the 19.2 GiB
      # limit) against the defaults, one call. Expected: the share within 5% of the defaults, or slower where the halved
      # plan costs more than the host saves; says whether "auto" may pick a share without timing the host. About 520 s
      run share-32-24gib 280 python benchmarks/lightning_user.py --varlen 256,4096 --seqs 32 --gpu-gib 24 \
        --configs newcomer-share0.3,newcomer --warmup 10 --steps 4 --config-timeout 135 --out "$OUT/share-32-24gib.json"
      run share-fixed-24gib 260 python benchmarks/lightning_user.py --gpu-gib 24 --configs newcomer-share0.3,newcomer \
        --warmup 12 --steps 6 --config-timeout 125 --out "$OUT/share-fixed-24gib.json" ;;
    defaults-rest)  # the new default elsewhere: fixed 32 x 2048 on the full card (expected 49.5-51k, as
      # newcomer-devopt's 50,502), 32 a step of the varlen data (expected above the host's 41,377), and 8 a step at
      # 24 GiB, where the 32 GiB of states do not fit and "auto" keeps the host (expected 15-21k as before). About 330 s
      run defaults-fixed 150 python benchmarks/lightning_user.py --configs newcomer --warmup 8 --steps 6 \
        --config-timeout 140 --out "$OUT/defaults-fixed.json"
      run defaults-32 160 python benchmarks/lightning_user.py --varlen 256,4096 --seqs 32 --configs newcomer \
        --warmup 10 --steps 4 --config-timeout 150 --out "$OUT/defaults-32.json"
      run defaults-8-24gib 170 python benchmarks/lightning_user.py --varlen 256,4096 --seqs 8 --gpu-gib 24 \
        --configs newcomer --warmup 26 --steps 6 --config-timeout 160 --out "$OUT/defaults-8-24gib.json" ;;
    fixed-devopt)  # the same on fixed 32 x 2048, full card (49.3-49.5k with the defaults): expected not slower,
      # the plan under 0.8 of the card less the 32 GiB of states. About 300 s
      run fixed-devopt 340 python benchmarks/lightning_user.py --configs newcomer-devopt,newcomer --warmup 8 \
        --steps 6 --config-timeout 160 --out "$OUT/fixed-devopt.json" ;;
    varlen-8-noop)  # an optimizer that does nothing (the host's math gone; its casts and transfers left), 8 a step
      run varlen-8-noop 200 python benchmarks/lightning_user.py --varlen 256,4096 --seqs 8 --configs newcomer-noop \
        --warmup 10 --steps 8 --host-trace --config-timeout 180 --out "$OUT/varlen-8-noop.json" ;;
    varlen-8-ceiling)  # issue 39: 8 a step, the defaults beside SGD in AdamW's place (12 bytes a parameter through
      # host memory against 28: the host step near 0.15 + 0.19 s instead of 0.47 + 0.19): if the host bounds the step,
      # SGD's tokens/s is what the devices give with a lighter host step (expected 30-35k against 24k). About 230 s
      run varlen-8-ceiling 330 python benchmarks/lightning_user.py --varlen 256,4096 --seqs 8 \
        --configs newcomer,newcomer-sgd --warmup 10 --steps 8 --host-trace --config-timeout 130 \
        --out "$OUT/varlen-8-ceiling.json" ;;
    memory-24gib)  # issue 39: at 24 GiB and 8 a step the reserve crept to 21.6 GiB, NVML 23.1 (the issue allows 0.8 x 24
      # GiB plus the 1.4 GiB context: 20.6). Two ways to hold it, the gentler first: the cache given back after a batch
      # that ended above the plan's limit (newcomer-release), and the allocator capped at the limit (newcomer-capped,
      # whose first try ran past 170 s against the uncapped 118 s). Expected NVML under 20.6 GiB for both, release
      # within 5% of the uncapped 21,142 real tokens/s. About 300-420 s
      run varlen-8-24gib-memory 460 python benchmarks/lightning_user.py --varlen 256,4096 --seqs 8 --gpu-gib 24 \
        --configs newcomer-release,newcomer-capped --warmup 26 --steps 8 --config-timeout 210 \
        --out "$OUT/varlen-8-24gib-memory.json" ;;
    reserve-24gib)  # issue 39: NVML 21.8-23.9 GiB at 24 GiB and 8 a step against the 20.6 allowed; the allocator's
      # reserve reached 20.8 GiB against torch's peak of 15.0 (2026-12-07). A freed block serves only the stream it was
      # allocated on: step_log's by_stream (each stream's segments, reserved and in use, at each new high of the
      # reserve) says which pools hold the rest. Expected: compute's and param_up's reserves each well above their
      # in-use bytes at the high, summing to the 5 GiB. About 200 s
      run reserve-24gib 260 python benchmarks/lightning_user.py --varlen 256,4096 --seqs 8 --gpu-gib 24 \
        --configs newcomer --warmup 20 --steps 6 --config-timeout 220 --out "$OUT/reserve-24gib.json" ;;
    uppool-24gib)  # issue 39: the weights' device buffers from the compute stream's pool (2026-12-07), against
      # the uploads' own pool as before (newcomer-uppool) and without the next batch's first buffers taken ahead
      # (newcomer-noahead), 24 GiB, 8 a step. First run (H100, 2026-12-07): uppool 21,817 tokens/s, NVML 21.60,
      # torch's peak 15.0; the defaults 20,679, 21.81, 17.68 (three slots' weights at once: the next slot's taken
      # before a run while the slot before was held to its unload). With the weights released after their run's
      # last compute and every buffer from compute's pool, expected: the defaults' torch peak near 15-16 GiB,
      # NVML under 20.6, param_up's reserve near 0, tokens/s within 3% of uppool's. About 260 s
      run uppool-24gib 330 python benchmarks/lightning_user.py --varlen 256,4096 --seqs 8 --gpu-gib 24 \
        --configs "${UPPOOL_CONFIGS:-newcomer-uppool,newcomer-noahead,newcomer}" --warmup 20 --steps 6 \
        --config-timeout 220 --out "$OUT/uppool-24gib.json" ;;
    uppool-fixed)  # the same three on fixed 32 x 2048, full card, where the uploads are not hidden behind a host
      # step: the batch's first upload overlapping the previous batch's last run is what noahead keeps and the
      # defaults keep by taking its buffers ahead. First run: 48,645 / 48,695 / 48,406, NVML 59.43 / 59.42 / 62.63
      # (the first batch's buffers left in param_up's pool). Expected now: the defaults' NVML near uppool's and
      # within 1% of its tokens/s; noahead slower by up to the first upload (3.2 GiB at 50 GB/s a 1.35 s step: 5%).
      # About 245 s
      run uppool-fixed 300 python benchmarks/lightning_user.py \
        --configs "${UPPOOL_CONFIGS:-newcomer-uppool,newcomer-noahead,newcomer}" --warmup 8 --steps 6 \
        --config-timeout 110 --out "$OUT/uppool-fixed.json" ;;
    memory-24gib-fixed)  # the same two on fixed 32 x 2048 at 24 GiB (39-40k once settled, NVML 25.1-25.4 GiB during
      # CacheWatch's trial in earlier sessions): not slower is the ask. About 300-420 s
      run fixed-32-24gib-memory 460 python benchmarks/lightning_user.py --gpu-gib 24 \
        --configs newcomer-release,newcomer-capped --warmup 26 --steps 6 --config-timeout 210 \
        --out "$OUT/fixed-32-24gib-memory.json" ;;
    varlen-24gib-gc)  # issue 39: at 24 GiB the allocator's reserve crept up with the lengths (16.8 to 20.4 GiB over 30
      # steps at 8 a step, 2026-12-04) past the plan's 19.2: torch's garbage collection of cached blocks from 0.8 of the
      # cap (where the plan's limit is) on, 8 then 32 a step (about 300 s)
      export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True,garbage_collection_threshold:0.8
      run varlen-8-24gib-gc 150 python benchmarks/lightning_user.py --varlen 256,4096 --seqs 8 --gpu-gib 24 \
        --configs newcomer --warmup 26 --steps 8 --config-timeout 140 --out "$OUT/varlen-8-24gib-gc.json"
      run varlen-32-24gib-gc 220 python benchmarks/lightning_user.py --varlen 256,4096 --seqs 32 --gpu-gib 24 \
        --configs newcomer --warmup 14 --steps 4 --config-timeout 210 --out "$OUT/varlen-32-24gib-gc.json"
      unset PYTORCH_CUDA_ALLOC_CONF ;;
    varlen-expandable)  # issue 39: 32 a step, full card, the allocator's expandable segments (fragmentation). About 200 s
      PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True run varlen-32-expandable 210 python benchmarks/lightning_user.py \
        --varlen 256,4096 --configs newcomer --seqs 32 --warmup 10 --steps 4 --config-timeout 200 \
        --out "$OUT/varlen-32-expandable.json" ;;
    headline)  # issue 41: the best plain (compiled blocks at 4 and 8 sequences a micro-batch), plain with Liger, and
      # roundpipe's defaults, 32 x 2048 tokens a step, full card, one call (about 480 s); then headline-zero
      run headline-mb4 300 python benchmarks/lightning_user.py --configs plain-compile,plain-liger,newcomer \
        --micro-batch 4 --warmup 8 --steps 6 --config-timeout 100 --out "$OUT/headline-mb4.json"
      run headline-mb8 200 python benchmarks/lightning_user.py --configs plain-compile,plain-liger --micro-batch 8 \
        --warmup 6 --steps 6 --config-timeout 95 --out "$OUT/headline-mb8.json" ;;
    headline-24gib)  # issue 41: roundpipe's defaults capped at 24 GiB until the plan settles (plain does not fit: the
      # fp32 weights, gradients and Adam states of 1.7 B parameters are 27 GB), every step's time and plan recorded
      run headline-24gib 300 python benchmarks/lightning_user.py --gpu-gib 24 --configs newcomer --warmup 30 \
        --steps 8 --config-timeout 290 --out "$OUT/headline-24gib.json" ;;
    headline-zero|headline-zero-24gib)  # issue 41, after ds-setup and ds-wait: DeepSpeed ZeRO-2 and ZeRO-3 offload with
      # compiled blocks and with Liger, micro-batches of 4 (about 8 minutes; the 24 GiB card: micro-batches of 2)
      cap=$([ "$step" = headline-zero-24gib ] && echo "--gpu-gib 24 --micro-batch 2" || echo "--micro-batch 4")
      run "$step" 560 python benchmarks/lightning_user.py $cap \
        --configs zero2-offload-compile,zero2-offload-liger,zero3-offload-compile,zero3-offload-liger \
        --warmup 4 --steps 4 --config-timeout 135 --out "$OUT/$step.json" ;;
    varlen-shapes)  # issue 39: the per-shape cost of cuDNN's attention (docs/perf-notes.md, thirteenth): the default,
      # widths rounded up to 128 columns (shapes repeat), flash attention first; 32 a step, full card. About 400 s
      run varlen-32-shapes 420 python benchmarks/lightning_user.py --varlen 256,4096 --seqs 32 \
        --configs newcomer,newcomer-width128,newcomer-flash --warmup 8 --steps 4 --config-timeout 130 \
        --out "$OUT/varlen-32-shapes.json" ;;
    varlen-24gib-pool)  # issue 39: 24 GiB after the host pool's reuse (fce8a28) and expandable segments (1db8e55)
      run varlen-32-24gib-pool 230 python benchmarks/lightning_user.py --varlen 256,4096 --seqs 32 --gpu-gib 24 \
        --configs newcomer --warmup 12 --steps 4 --config-timeout 220 --out "$OUT/varlen-32-24gib-pool.json" ;;
    varlen-8-shapes)  # issue 39: 8 a step ran 14,824 real tokens/s with 4 micro-batches chosen (2026-12-03, fourteenth)
      # against 20,552 with 1 (thirteenth): the default (compile's recompile reasons logged), packed micro-batches
      # (one row each, no padding, varlen flash), one micro-batch, widths rounded up to 256 columns. About 520 s
      TORCH_LOGS=recompiles run varlen-8-shapes 580 python benchmarks/lightning_user.py --varlen 256,4096 --seqs 8 \
        --configs newcomer,newcomer-packed,tuned-1,newcomer-width256 --warmup 10 --steps 6 --config-timeout 140 \
        --out "$OUT/varlen-8-shapes.json" ;;
    varlen-plain-packed)  # issue 39's plain with packing: transformers' DataCollatorWithFlattening rows, each block
      # compiled, and plain with Liger packed, 32 a step on the full card (about 330 s)
      run varlen-32-plain-packed 340 python benchmarks/lightning_user.py --varlen 256,4096 --seqs 32 \
        --configs plain-compile-packed,plain-liger-packed --warmup 6 --steps 4 --config-timeout 165 \
        --out "$OUT/varlen-32-plain-packed.json" ;;
    varlen-packed)  # issue 39: split_by="packed" (torch's varlen flash attention, no padding) and the default fed
      # transformers' flattened rows, against the default on padded batches, 32 a step on the full card; the GPU
      # tests of both first. About 420 s. (Its first run, 2026-12-03, fed newcomer-packed flattened rows by mistake.)
      run gpu-tests-packed 150 python -m pytest -q -s -p no:cacheprovider -m gpu tests/test_packed.py \
        tests/test_flattened.py
      run varlen-32-packed 440 python benchmarks/lightning_user.py --varlen 256,4096 --seqs 32 \
        --configs newcomer,newcomer-packed,newcomer-flattened --warmup 8 --steps 4 --config-timeout 140 \
        --out "$OUT/varlen-32-packed.json" ;;
    varlen-packed-24gib)  # issue 39: the same at 24 GiB, packed and flattened (about 300 s)
      run varlen-32-24gib-packed 320 python benchmarks/lightning_user.py --varlen 256,4096 --seqs 32 --gpu-gib 24 \
        --configs newcomer-packed,newcomer-flattened --warmup 10 --steps 4 --config-timeout 150 \
        --out "$OUT/varlen-32-24gib-packed.json" ;;
    varlen-8-packed)  # issue 39: split_by="packed" at 8 a step (2026-12-04: "no loss for micro-batches [1]" at step 6,
      # where the driver kept only the outer traceback), the flattened GPU test first. About 180 s
      run gpu-tests-flattened 120 python -m pytest -q -s -p no:cacheprovider -m gpu tests/test_flattened.py
      run varlen-8-packed 200 python benchmarks/lightning_user.py --varlen 256,4096 --seqs 8 \
        --configs newcomer-packed --warmup 10 --steps 6 --config-timeout 180 --out "$OUT/varlen-8-packed.json" ;;
    varlen-packed-8-24gib)  # issue 39: split_by="packed" at 8 a step on the full card and at 32 a step on 24 GiB, the
      # flattened GPU test first (its spy on the flash kernel recompiled per call on 2026-12-04). About 400 s
      run gpu-tests-packed 150 python -m pytest -q -s -p no:cacheprovider -m gpu tests/test_packed.py \
        tests/test_flattened.py
      run varlen-8-packed 200 python benchmarks/lightning_user.py --varlen 256,4096 --seqs 8 \
        --configs newcomer-packed --warmup 10 --steps 6 --config-timeout 180 --out "$OUT/varlen-8-packed.json"
      run varlen-32-24gib-packed 200 python benchmarks/lightning_user.py --varlen 256,4096 --seqs 32 --gpu-gib 24 \
        --configs newcomer-packed --warmup 10 --steps 4 --config-timeout 180 --out "$OUT/varlen-32-24gib-packed.json" ;;
    liger-profile)  # issue 41: plain with Liger ran 21,444 at 4 sequences a micro-batch and 29,227 at 8, plain with
      # compiled blocks 35,086 and 35,170 (2026-12-03, fourteenth): one profiled step of each, by kernel kind. About 300 s
      run liger-profile-mb4 200 python benchmarks/lightning_user.py --configs plain-liger,plain-compile --micro-batch 4 \
        --warmup 4 --steps 2 --profile --config-timeout 95 --out "$OUT/liger-profile-mb4.json"
      run liger-profile-mb8 110 python benchmarks/lightning_user.py --configs plain-liger --micro-batch 8 \
        --warmup 4 --steps 2 --profile --config-timeout 100 --out "$OUT/liger-profile-mb8.json" ;;
    qlora-70b)  # issue 40 (bitsandbytes carried as a wheel): the Llama-3.1-70B shape, NF4 base, LoRA r=16, roundpipe's
      # defaults at 24 GiB, then plain Lightning QLoRA (checkpointing) on the full card. Not yet run: budget a call
      run qlora-70b-roundpipe 300 python benchmarks/qlora.py --shape llama-70b --configs roundpipe --gpu-gib 24 \
        --warmup 4 --steps 2 --config-timeout 290 --out "$OUT/qlora-70b-roundpipe.json"
      run qlora-70b-plain 230 python benchmarks/qlora.py --shape llama-70b --configs plain --warmup 2 --steps 2 \
        --config-timeout 220 --out "$OUT/qlora-70b-plain.json" ;;
    qlora-8b)  # issue 40: the Llama-3.1-8B shape at 24 GiB, 4-bit base against bf16 base (LoRA both), roundpipe's defaults
      run qlora-8b 420 python benchmarks/qlora.py --shape llama-8b --configs roundpipe,roundpipe-bf16 --gpu-gib 24 \
        --warmup 6 --steps 3 --config-timeout 200 --out "$OUT/qlora-8b.json" ;;
    generic)  # issue 38: the table's stages against the generic path, full card, one call. About 200 s
      run generic 260 python benchmarks/lightning_user.py --configs newcomer,newcomer-generic --warmup 10 --steps 6 \
        --config-timeout 125 --out "$OUT/generic.json" ;;
    generic-24gib)  # issue 38: families without an entry, 2-3 B parameters, every default, 24 GiB. About 330 s
      for model in cohere-2b deepseek-v3-3b; do
        run "generic-$model" 200 python benchmarks/lightning_user.py --model "$model" --gpu-gib 24 --configs newcomer \
          --warmup 14 --steps 4 --config-timeout 190 --out "$OUT/generic-$model.json"
      done ;;
    ab-24gib)  # the default at 24 GiB from another commit's tree and from this one, in one call (39,760 on
      # 2471c9c against 40,523 on d1e679c, different calls). AB_TREE: that tree, e.g. made with
      # `git archive d1e679c | tar -x -C .ab` and carried (run(carry=[".ab"])). On a cold machine the first
      # run builds Inductor's and Triton's caches: 150 s was too short for it (2026-12-03). About 330 s
      (cd "${AB_TREE:?AB_TREE names the other tree}" && PYTHONPATH=$PWD:${PYTHONPATH#*:} run ab-other 240 \
        python benchmarks/lightning_user.py --gpu-gib 24 --configs newcomer --warmup 26 --steps 6 \
        --config-timeout 140 --out "$OUT/ab-other.json")
      run ab-this 150 python benchmarks/lightning_user.py --gpu-gib 24 --configs newcomer --warmup 26 --steps 6 \
        --config-timeout 140 --out "$OUT/ab-this.json" ;;
    defaults-4b)  # the 4B shape at 24 GiB (15,372 tokens/s eager with Liger's kernels). The allocator watch's
      # trial lands near batch 9-22 at 4 s a batch, and 10 warm-up steps left it inside the timed ones (2026-12-03:
      # 13,129 mixing two plans); 26 warm-up steps, as at 1.7B. About 260 s
      run defaults-4b 300 python benchmarks/lightning_user.py --model qwen3-4b --gpu-gib 24 --configs newcomer \
        --warmup 26 --steps 4 --config-timeout 290 --out "$OUT/defaults-4b.json" ;;
    defaults-8b)  # the 8B in bf16-true at 24 GiB (9,166-9,358 eager; 9,436 compiled on 2026-12-03). About 260 s
      run defaults-8b 280 python benchmarks/lightning_user.py --model qwen3-8b --precision bf16-true --gpu-gib 24 \
        --configs newcomer --warmup 18 --steps 4 --config-timeout 270 --out "$OUT/defaults-8b.json" ;;
    compile-24gib)  # the same at 24 GiB through the planner: with the host's launches gone, 8 micro-batches
      # may let the fused stage hold more blocks (the route to 40k). About 450 s
      run compile-24gib 560 python benchmarks/lightning_user.py --gpu-gib 24 \
        --configs newcomer-gm0.6-compile,tuned-8-gm0.6-compile,newcomer-gm0.6 --warmup 10 --steps 6 \
        --config-timeout 180 --out "$OUT/compile-24gib.json" ;;
    plain-liger-profile)  # plain with Liger ran 19,278 against plain's 21,017 (2026-12-02): where its time goes
      run plain-liger-profile 300 python benchmarks/lightning_user.py --configs plain,plain-liger --profile \
        --config-timeout 140 --out "$OUT/plain-liger-profile.json" ;;
    kernels-off-4b-8b)  # issue 24's "before" rows at 24 GiB: the 4B and the 8B (bf16-true) without the kernels
      # (with them: 15,373 and 9,358 tokens/s); the 4B's measuring batches took 9.7 s each, about 420 s in all
      run kernels-off-4b 250 python benchmarks/lightning_user.py --model qwen3-4b --gpu-gib 24 \
        --configs newcomer-nokernels --warmup 4 --config-timeout 240 --out "$OUT/kernels-off-4b.json"
      run kernels-off-8b 200 python benchmarks/lightning_user.py --model qwen3-8b --precision bf16-true \
        --gpu-gib 24 --configs newcomer-nokernels --config-timeout 190 --out "$OUT/kernels-off-8b.json" ;;
    lightning-user-long)  # batch size 1 at 131,072 tokens on the 24 GiB card, split and tiled layers, no other argument
      run lightning-user-long 300 python benchmarks/lightning_user.py --gpu-gib 24 --configs newcomer-split-tiled \
        --seqs 1 --seq-len 131072 --warmup 3 --steps 2 --config-timeout 280 --out "$OUT/lightning-user-long.json" ;;
    throughput-mem) run throughput-mem 420 python benchmarks/throughput.py --configs plain,roundpipe-priority \
      --fused-blocks 1 --out "$OUT/throughput-mem.json" ;;
    ds-setup)  # DeepSpeed from the carried wheels (run(carry=["wheels"])); its CPU Adam builds in the background
      python -c "import deepspeed" 2>/dev/null || python -m pip install -q --no-deps --no-index \
        $(ls wheels/*.whl | grep -v typing_extensions) > "$OUT/ds-setup.log" 2>&1
      rm -f ~/.cache/torch_extensions/*/cpu_adam/lock  # a build killed earlier would block every later one
      CUDA_HOME=${CUDA_HOME:-/usr/local/cuda} python -c \
        "from deepspeed.ops.op_builder import CPUAdamBuilder as B; B().load(); print('cpu_adam built')" \
        >> "$OUT/ds-setup.log" 2>&1 &
      DS_BUILD=$! ;;
    ds-wait)  # after ds-setup: wait for its CPU Adam build, so that a later call on the warm machine finds it
      # built (a build running beside a benchmark would take the host cores its optimizer step needs)
      [ -n "${DS_BUILD:-}" ] && wait "$DS_BUILD"; tail -n 3 "$OUT/ds-setup.log" ;;
    baselines-1.7b)  # the 1.7B matrix in one call (about 8 minutes); the 4B one needs two calls
      run baselines-1.7b-a 260 python benchmarks/baselines.py --configs plain,roundpipe,fsdp-offload \
        --config-timeout 120 --out "$OUT/baselines-1.7b-a.json"
      [ -n "${DS_BUILD:-}" ] && wait "$DS_BUILD"; tail -n 3 "$OUT/ds-setup.log"
      run baselines-1.7b-b 320 python benchmarks/baselines.py --configs zero2-offload,zero3-offload \
        --config-timeout 200 --out "$OUT/baselines-1.7b-b.json" ;;
    baselines-24gib)  # measured 2026-11-30: roundpipe and fsdp-offload about 100 s each
      run baselines-24gib 300 python benchmarks/baselines.py --configs roundpipe,fsdp-offload \
        --gpu-gib 24 --config-timeout 140 --out "$OUT/baselines-24gib.json" ;;
    baselines-24gib-zero) [ -n "${DS_BUILD:-}" ] && wait "$DS_BUILD"  # zero2-offload took 123 s (2026-11-30)
      run baselines-24gib-zero 440 python benchmarks/baselines.py --configs zero2-offload,zero3-offload \
        --gpu-gib 24 --config-timeout 210 --out "$OUT/baselines-24gib-zero.json" ;;
    baselines-4b)  # building and pinning 4 B parameters and tearing them down take about a minute per config
      run baselines-4b 580 python benchmarks/baselines.py --model qwen3-4b --configs plain,roundpipe,fsdp-offload \
        --warmup 4 --config-timeout 190 --out "$OUT/baselines-4b.json" ;;
    baselines-4b-zero) [ -n "${DS_BUILD:-}" ] && wait "$DS_BUILD"
      run baselines-4b-zero 580 python benchmarks/baselines.py --model qwen3-4b --configs zero2-offload,zero3-offload \
        --warmup 4 --config-timeout 285 --out "$OUT/baselines-4b-zero.json" ;;
    baselines-4b-24gib)  # measured 2026-12-01: roundpipe 114 s, fsdp-offload 158 s (11,605 and 9,366 tokens/s)
      run baselines-4b-24gib 530 python benchmarks/baselines.py --model qwen3-4b --configs roundpipe,fsdp-offload \
        --gpu-gib 24 --warmup 4 --config-timeout 250 --out "$OUT/baselines-4b-24gib.json" ;;
    baselines-4b-24gib-zero) [ -n "${DS_BUILD:-}" ] && wait "$DS_BUILD"
      run baselines-4b-24gib-zero 580 python benchmarks/baselines.py --model qwen3-4b --configs zero2-offload,zero3-offload \
        --gpu-gib 24 --warmup 4 --config-timeout 285 --out "$OUT/baselines-4b-24gib-zero.json" ;;
    maxseq24-roundpipe-split) run "$step" 560 python benchmarks/baselines.py --max-seq roundpipe --split-blocks \
      --gpu-gib 24 --seq-len 131072 --seq-step 16384 --probe-timeout 200 --out "$OUT/$step.json" ;;
    baselines-split)  # roundpipe with each block as two layers, on the full card and on 24 GiB: what the split costs
      run baselines-split 400 python benchmarks/baselines.py --configs roundpipe --split-blocks --config-timeout 150 \
        --out "$OUT/baselines-split.json"
      run baselines-split-24gib 200 python benchmarks/baselines.py --configs roundpipe --split-blocks --gpu-gib 24 \
        --config-timeout 150 --out "$OUT/baselines-split-24gib.json" ;;
    maxseq24-tiled-4x|maxseq24-tiled-5x)  # one probe of 4x / 5x FSDP's 65,536 with split blocks and tiled token-wise
      # parts: a step of 262k-328k tokens is mostly causal attention (about 1-2 minutes each on an H200), so no search
      seq=$([ "$step" = maxseq24-tiled-4x ] && echo 262144 || echo 327680)
      run "$step" 580 python benchmarks/baselines.py --run roundpipe --split-blocks --tile-tokens 16384 --gpu-gib 24 \
        --seqs 1 --micro-batch 1 --seq-len "$seq" --warmup 2 --steps 1 ;;
    maxseq24-zero2-probes) [ -n "${DS_BUILD:-}" ] && wait "$DS_BUILD"  # after ds-setup; measured 2026-12-01: 56 and 68 s
      for seq in 81920 65536; do  # the two lengths around the other baselines' longest, as --max-seq probes them
        run "maxseq24-zero2-$seq" 200 python benchmarks/baselines.py --run zero2-offload --gpu-gib 24 --seqs 1 \
          --micro-batch 1 --seq-len "$seq" --warmup 1 --steps 1
      done ;;
    maxseq24-*) config=${step#maxseq24-}  # measured 2026-11-29: roundpipe and fsdp-offload fit 65,536, fail 131,072
      start=$([ "$config" = roundpipe ] || [ "$config" = fsdp-offload ] && echo 65536 || echo 32768)
      run "$step" 560 python benchmarks/baselines.py --max-seq "$config" --gpu-gib 24 --seq-len "$start" \
        --seq-step 16384 --probe-timeout 150 --out "$OUT/$step.json" ;;
    hf-padded) run hf-padded 300 python benchmarks/hf_preset.py --configs preset,preset-padded --steps 3 \
      --out "$OUT/hf-padded.json" ;;  # a padding mask no longer costs a host sync per block
    pcie) run pcie 60 python benchmarks/pcie.py --out "$OUT/pcie.json" ;;
    scaling-1.7b) run scaling-1.7b 300 python benchmarks/scaling.py --models qwen3-1.7b --out "$OUT/scaling-1.7b.json" ;;
    scaling-1.7b-mb4) run scaling-1.7b-mb4 300 python benchmarks/scaling.py --models qwen3-1.7b --micro-batch 4 \
      --out "$OUT/scaling-1.7b-mb4.json" ;;
    scaling-4b) run scaling-4b 400 python benchmarks/scaling.py --models qwen3-4b --out "$OUT/scaling-4b.json" ;;
    maxseq-1) maxseq 1 ;;
    maxseq-all) maxseq "$GPUS" ;;
    maxseq-all-gm0.65) maxseq "$GPUS" 0.65 ;;  # the plan leaves room for the allocator's fragmentation
    *) echo "unknown step $step" ;;
  esac
done
