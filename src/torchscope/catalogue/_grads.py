"""The catalogue's `grads.*` entries: what `torchscope.grads` says about one step's gradients
and about a watched loop (docs/diagnosis.md gives each criterion in full). The rank-aware
`grads.rank_skew` and `grads.ranks_diverge` are in `_distributed`."""

from __future__ import annotations

from torchscope.catalogue._base import ANY, ERROR, INFO, INFO_WARNING, WARNING, WARNING_ERROR
from torchscope.findings import Entry, Subject

_GLOROT = ("Glorot & Bengio 2010, Understanding the difficulty of training deep feedforward "
           "neural networks (AISTATS)")
_HE = ("He et al. 2015, Delving deep into rectifiers (arXiv 1502.01852)")
_PASCANU = ("Pascanu, Mikolov & Bengio 2013, On the difficulty of training recurrent neural "
            "networks (arXiv 1211.5063)")
_CS231N = ("CS231n, 'Neural Networks Part 3: Learning and Evaluation' (ratio of updates to "
           "weights, about 1e-3)")

# The fix a finding about clipping gives in each framework's own setting.
_CLIP = {
    "plain": "torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0) between "
             "loss.backward() and optimizer.step()",
    "lightning": "Trainer(gradient_clip_val=1.0) (gradient_clip_algorithm=\"norm\")",
    "hf": "TrainingArguments(max_grad_norm=1.0) (the Trainer's default; check it was not "
          "set to 0 or None)",
}

ENTRIES: tuple[Entry, ...] = (
    Entry(
        code="grads.vanishing",
        title="Vanishing gradients",
        subject=Subject.MODEL,
        levels=ANY,
        severity="by how far the weights' gradients fall toward the input: info from 10× "
                 "(\"possible\"), warning from 100× (\"likely\"), error from 10⁵× "
                 "(\"severe\"); a bottleneck without a steady trend is info.",
        meaning="The gradients of the weights shrink toward the input, so the first layers "
                "learn orders of magnitude more slowly than the last, or not at all. Raw "
                "norms are not compared (they grow with a layer's size); the relative "
                "gradient ‖g‖/‖w‖ and the gradient RMS are.",
        criterion="Over the body's depth positions (repeated blocks combined, the head and "
                  "embeddings left out; docs/diagnosis.md, 'Depth profile'), a least-squares "
                  "fit of log10(measure) against position, within each stack of blocks: the "
                  "relative gradient and the RMS both fall steadily (R² ≥ 0.75 in both) over "
                  "3 positions or more; the weaker decay decides (GradThresholds possible "
                  "10, likely 100, severe 1e5). Without a steady trend, a position 1000× "
                  "below a nearer one in both measures is a possible bottleneck (info).",
        fix="replace saturating activations (Sigmoid, Tanh) with ReLU/GELU-family ones; "
            "initialise for the activation (He et al. 2015 for ReLU, Glorot & Bengio 2010 "
            "for tanh); add normalization layers or residual connections.",
        literature="Hochreiter 1991; Bengio, Simard & Frasconi 1994; " + _GLOROT + "; " + _HE,
        example="likely vanishing gradients: the relative gradient ‖g‖/‖w‖ falls 1.1e+04× "
                "over 9 layers toward the input (2.8× per layer, steady: fit R² 0.99), "
                "from layers.8 to layers.0",
    ),
    Entry(
        code="grads.exploding",
        title="Exploding gradients",
        subject=Subject.MODEL,
        levels=ANY,
        severity="a steady growth toward the input of 100× or more, or a total norm above "
                 "1000, is a warning; a total above 10⁶, or a growth of 10⁵×, an error. "
                 "Growth from 10× is info only where the weights' relative gradient grows "
                 "10× too; a large total held by parameters with zero or tiny weights "
                 "before a normalization is info.",
        meaning="Gradients that grow toward the input, or a total norm out of bounds, make "
                "updates that overshoot: the loss jumps or turns NaN. The backward signal of "
                "a residual stack adds up block after block, so a mild growth alone is no "
                "fault.",
        criterion="The RMS of the gradient arriving at each depth position grows steadily "
                  "toward the input (R² ≥ 0.75, 3 positions or more) by 100× (likely) or by "
                  "10× with the relative gradient growing 10× too (possible); the total norm "
                  "(what clip_grad_norm_ returns) above exploding_norm = 1000 (warning) or "
                  "exploding_error_norm = 1e6 (error). Over a watched run, the total growing "
                  "100× between the first and the last sample is a warning.",
        fix="clip the gradient norm (" + _CLIP["plain"] + "); lower the init scale; add "
            "normalization layers; lower the learning rate.",
        fixes={"lightning": "clip with " + _CLIP["lightning"] + "; lower the init scale, add "
                            "normalization, lower the learning rate.",
               "hf": "clip with " + _CLIP["hf"] + "; lower the init scale, add "
                     "normalization, lower learning_rate."},
        literature=_PASCANU,
        example="likely exploding gradients: the gradient arriving at each layer grows "
                "2.1e+04× over 8 layers toward the input (4.1× per layer, steady: fit R² "
                "1.00), from layers.7 to layers.0; total norm 1.6e+06",
    ),
    Entry(
        code="grads.dead",
        title="No gradient reaches or leaves a module",
        subject=Subject.MODEL,
        levels=WARNING,
        severity="always a warning: a module whose gradient is exactly zero does not learn "
                 "in this step.",
        meaning="A module receives an all-zero gradient, or its own parameters get one, or "
                "it receives a gradient but passes an all-zero one down (every ReLU unit "
                "off, a mask that blocks every position, a dropout that dropped everything). "
                "The one that passes none down is the cause; the modules below it are told "
                "with it, in one finding. A step in which nothing got any gradient is put "
                "down to the loss.",
        criterion="Norms of exactly 0 (GradThresholds.dead_norm = 0): every grad_output of "
                  "a module, or every gradient of its trainable parameters; a module whose "
                  "output gradient is non-zero and input gradient zero passes none down. "
                  "Frozen modules are never judged. A gradient under 1e-20 reaching a "
                  "module reads as vanished (float32 rounds the products to 0), not blocked.",
        fix="look for dead ReLUs (lower the learning rate, LeakyReLU/GELU), a branch "
            "multiplied by zero, a mask that blocks every position, an output the loss reads "
            "no element of, or a softmax over one element.",
        example="encoder.2.act (ReLU) receives gradient but passes an all-zero gradient down",
    ),
    Entry(
        code="grads.zero_init",
        title="Modules that start at zero",
        subject=Subject.MODEL,
        levels=INFO,
        severity="info: a deliberate zero init passes no gradient down until the optimizer "
                 "first moves it.",
        meaning="A module whose trainable parameters are all exactly zero (LoRA's B, a "
                "residual branch's last norm gain under zero_init_residual) receives "
                "gradient but passes none down, so the modules of its layer get none in this "
                "step. Expected at the first step; at a later one it means that the "
                "optimizer does not move those parameters.",
        criterion="A module that passes an all-zero gradient down while every one of its "
                  "own trainable parameters reads exactly 0 when the gradient is read; the "
                  "modules of its layer (its parent, or the adapter's layer) that get or pass "
                  "none are named with it, not as grads.dead.",
        fix="nothing at the first step; if later steps still show it, the optimizer does "
            "not move those parameters: check that they are in its parameter groups with a "
            "non-zero learning rate.",
        example="2 module(s) start at zero (q_proj.lora_B.default, v_proj.lora_B.default): "
                "all their parameters are 0, a deliberate zero init",
    ),
    Entry(
        code="grads.nonfinite",
        title="NaN/Inf gradients",
        subject=Subject.MODEL,
        levels=ERROR,
        severity="always an error: a NaN/Inf gradient turns the weights NaN at the next "
                 "update.",
        meaning="A gradient holds NaN or Inf. Where the loss is itself non-finite, the "
                "forward made it (activations.nonfinite names the module); otherwise the "
                "first module in backward order whose gradient is non-finite is named, and "
                "whether its backward made it (a sqrt or log at 0) or it arrived from above.",
        criterion="Any non-finite norm: a module's output or input gradient, a parameter's "
                  "gradient, or the total. Over a watched run, the first sampled step whose "
                  "total norm is NaN/Inf.",
        fix="look for log(0), division by zero, sqrt of negatives or fp16 overflow (use "
            "GradScaler or bf16); torch.autograd.detect_anomaly() names the op.",
        example="NaN/Inf gradient first appears at blocks.2.attn in backward order: it is "
                "produced by its backward",
    ),
    Entry(
        code="grads.nonfinite_update",
        title="An optimizer update wrote NaN/Inf",
        subject=Subject.LOOP,
        levels=ERROR,
        severity="always an error: every later forward computes with the broken weights.",
        meaning="The optimizer's update turned finite weights with finite gradients into "
                "NaN/Inf. Every NaN/Inf that later steps show starts at this update, not in "
                "the module that first produces it from the weights. The usual cause: Adam's "
                "default eps of 1e-8 is 0 in float16, and a running square that underflows "
                "to 0 makes the step divide by 0.",
        criterion="On sampled steps with update ratios measured (optimizer=, updates=True): "
                  "a parameter whose update norm is NaN/Inf while its weight norm (read "
                  "before the update) and its gradient norm were finite. The eps is named "
                  "where it is at most half the dtype's smallest number and the optimizer "
                  "divides by a running statistic plus eps.",
        fix="lower the learning rate; with half-precision weights, keep them in float32 "
            "under torch.autocast (with a GradScaler for float16); a custom optimizer that "
            "divides by a running statistic needs an eps the dtype holds.",
        fixes={"lightning": "train with Trainer(precision=\"16-mixed\") or \"bf16-mixed\" "
                            "(float32 weights), not \"16-true\"; or pass an eps float16 "
                            "holds (1e-4) in configure_optimizers.",
               "hf": "keep the model in float32 and set fp16=True or bf16=True in "
                     "TrainingArguments (mixed precision), rather than loading it with "
                     "torch_dtype=torch.float16; or set adam_epsilon=1e-4."},
        example="AdamW's update at step 0 wrote NaN/Inf into 27 of 28 parameters (...) "
                "whose weights and gradients were finite: AdamW's eps=1e-08 is 0 in float16",
        explains=("grads.nonfinite", "activations.nonfinite"),
    ),
    Entry(
        code="grads.loss_broadcast",
        title="The loss broadcast the output against its target",
        subject=Subject.LOOP,
        levels=WARNING_ERROR,
        severity="an error where every prediction met every target ((N, 1) against (N,)); "
                 "a warning where the output was broadcast along a larger target's own rows "
                 "((N, 1) against (N, K)), which may rarely be meant.",
        meaning="The loss compared the model's output with a target of as many elements laid "
                "out otherwise: (N, 1) predictions against (N,) targets make an (N, N) table, "
                "and each prediction's gradient pulls it toward the mean of all targets. The "
                "model learns the targets' mean; gradients reach every layer at ordinary "
                "sizes, so nothing else reads wrong.",
        criterion="Read once on autograd's graph before backward, breadth first from the "
                  "loss toward the output (1024 nodes at most; no tensor is read): the first "
                  "node above the output that does not keep its n elements holds n × n, and "
                  "its other operand carries no gradient. Along a target's rows: it holds "
                  "n × K, the operand is known to be the target (the one mse_loss, "
                  "huber_loss or smooth_l1_loss saved, or the step's under l1_loss), and the "
                  "output fills it by its size-1 dimensions.",
        fix="give the output and the target one shape before the loss (target.view_as("
            "output), or squeeze the output's size-1 dimension).",
        example="the loss broadcast the output (32, 1) against the target (32,) into "
                "(32, 32) (SubBackward0): it compares every prediction with every target",
    ),
    Entry(
        code="grads.loss_on_probabilities",
        title="A loss that takes probabilities as logits",
        subject=Subject.LOOP,
        levels=WARNING_ERROR,
        severity="an error where the loss is the training's own (a loss_fn callable, the "
                 "model's .loss, a loss handed to check_loss); a warning where torchscope "
                 "chose the loss (loss_fn=\"auto\" or a named one), since the training is "
                 "wrong only if it takes the same loss.",
        meaning="The loss applies its own softmax or sigmoid to an output that already went "
                "through one. Cross-entropy of softmax probabilities cannot fall below "
                "log(1 + (C − 1)/e) (1.46 for ten classes) and its gradient shrinks as they "
                "saturate: training stalls. nll_loss of probabilities computes −p, not "
                "−log p. The runtime side of the lint rule TS014.",
        criterion="On the same walk as grads.loss_broadcast: a SoftmaxBackward0 "
                  "(SigmoidBackward0) at the output or above it, then, through ops that keep "
                  "the probabilities as they are (views, casts, copies, slices), "
                  "LogSoftmaxBackward0, NllLossBackward0 or "
                  "BinaryCrossEntropyWithLogitsBackward0. A log or any other op between them "
                  "ends it.",
        fix="give the loss the logits: drop the final Softmax/Sigmoid layer (apply it only "
            "to report probabilities), or use log_softmax with nll_loss.",
        example="cross-entropy takes log_softmax of the output (64, 10), a softmax's result: "
                "probabilities taken as logits, so the loss cannot fall below "
                "log(1 + (C - 1)/e) = 1.46 (C = 10)",
    ),
    Entry(
        code="grads.padding_in_loss",
        title="The loss trains on padding",
        subject=Subject.DATA,
        levels=WARNING,
        severity="always a warning: the model learns to predict the pad token.",
        meaning="A transformers model's labels hold a token, not -100, at positions that its "
                "attention mask pads and its loss reads. Its loss ignores only -100, so it "
                "trains the model to predict the pad token there (for GPT-2 and Llama, whose "
                "pad token is often the end-of-sequence token, to end every text early). "
                "labels = input_ids.clone() after padding does it.",
        criterion="A transformers model (no encoder-decoder) given labels and an "
                  "attention_mask of one shape: of the positions the mask pads that the loss "
                  "reads (from position 1 for a causal LM, whose loss shifts the labels), "
                  "those whose label is not -100, over every micro-batch; any is a finding.",
        fix="set the labels to -100 where attention_mask is 0 (labels[attention_mask == 0] "
            "= -100), or build the batches with DataCollatorForLanguageModeling(tokenizer, "
            "mlm=False), which does.",
        example="the loss trains on padding: 22 of the 22 label positions that the attention "
                "mask pads and the loss reads (in this step) hold a token, not -100",
    ),
    Entry(
        code="grads.unreached",
        title="Trainable parameters without a gradient",
        subject=Subject.MODEL,
        levels=INFO_WARNING,
        severity="info; a warning where a reentrant checkpoint dropped the gradients "
                 "(torch says no more than a UserWarning).",
        meaning="Trainable parameters received no gradient in the step: an auxiliary head "
                "the loss forgot, a branch not taken, an expert that got no token, a layer "
                "LayerDrop skipped. They cost optimizer state and break DDP without "
                "find_unused_parameters=True. Inside torch.utils.checkpoint with "
                "use_reentrant=True and inputs that do not require grad, every gradient is "
                "dropped.",
        criterion="A trainable parameter (not a tied alias) whose gradient is None after the "
                  "step's backward, by reason: not reached, ran under no_grad, did not run, "
                  "ran inside a reentrant checkpoint. One finding per module (the first "
                  "five, then one for the rest); a block or a stack none of whose modules "
                  "ran is one finding.",
        fix="if they should learn, make the loss depend on them; if not, freeze them "
            "(requires_grad_(False)) so that optimizers and DDP skip them. For a reentrant "
            "checkpoint, pass use_reentrant=False.",
        fixes={"lightning": "freeze them, or run DDP with "
                            "Trainer(strategy=\"ddp_find_unused_parameters_true\") where a "
                            "branch is meant to be skipped; for checkpoints, "
                            "use_reentrant=False.",
               "hf": "freeze them, or set ddp_find_unused_parameters=True in "
                     "TrainingArguments where a branch is meant to be skipped; for "
                     "gradient_checkpointing, gradient_checkpointing_kwargs="
                     "{\"use_reentrant\": False}."},
        example="aux_head: 2 trainable parameter(s) received no gradient (aux_head.weight, "
                "aux_head.bias)",
    ),
    Entry(
        code="grads.frozen",
        title="Frozen parameters",
        subject=Subject.MODEL,
        levels=INFO,
        severity="info: context, so that a reader knows which part is not trained.",
        meaning="Some parameters are frozen (requires_grad=False): not trained, and not "
                "judged by any other finding (a frozen layer is never called dead).",
        criterion="Every parameter with requires_grad=False (tied aliases counted once), "
                  "named once with the deepest module that holds all of them.",
        example="12 of 40 parameters are frozen (requires_grad=False) in 6 module(s) under "
                "backbone: not trained, and not judged",
    ),
    Entry(
        code="grads.frozen_zero",
        title="A frozen parameter that is all zero",
        subject=Subject.MODEL,
        levels=WARNING,
        severity="always a warning: nothing will ever change it.",
        meaning="A frozen parameter whose every value is zero: no optimizer moves it, so "
                "what it adds to or scales gets nothing from it, for good. transformers 5's "
                "ViT-MAE leaves its fixed sin-cos position tables zero when built from a "
                "config: every masked token enters the decoder as the same vector.",
        criterion="One count_nonzero per frozen parameter of up to 2**20 elements that is "
                  "not a bias, read with the gradient norms; not across ranks (DDP, FSDP2).",
        fix="give it the values it is meant to hold (a fixed position embedding needs its "
            "sin-cos table; a frozen weight, its pretrained values), or let it train "
            "(requires_grad_(True)) if zero is only its starting point.",
        example="decoder.decoder_pos_embed is frozen (requires_grad=False) and all zero: "
                "nothing will ever change it",
        explains=("grads.dead",),
    ),
    Entry(
        code="grads.update_ratio",
        title="The optimizer's step against the weights",
        subject=Subject.LOOP,
        levels=INFO_WARNING,
        severity="a warning from a median ‖Δw‖/‖w‖ of 0.1 (100× the rule of thumb); info "
                 "from 0.01, at or below 1e-5, and where no layer moved at all.",
        meaning="How far the optimizer moves each layer's weights, as a fraction of their "
                "norm. Much above about 1e-3 the learning rate is probably too high; much "
                "below, too low. Adam's first steps move each weight by about the learning "
                "rate, so small initial weights read high early, which warm-up is for.",
        criterion="The median over the layers of ‖Δw‖/‖w‖ of the optimizer's actual step, "
                  "measured on sampled steps (optimizer=, updates=True): ≥ update_high = "
                  "0.1 warning, ≥ update_elevated = 0.01 info, ≤ update_low = 1e-5 info. "
                  "Layers that started at zero are left out; under Muon (which moves a "
                  "matrix by about its learning rate by design) a median below 0.1 is not "
                  "called large; a small step on a clipped step names the clipping, and over "
                  "a run one after the gradient norm fell 10× is what a fitting model takes.",
        fix="too large: lower the learning rate or warm it up; too small: raise it, or check "
            "that the scheduler did not decay it to nothing.",
        fixes={"lightning": "set the learning rate in configure_optimizers, and return a "
                            "warm-up scheduler with it ({\"optimizer\": opt, "
                            "\"lr_scheduler\": ...}).",
               "hf": "set learning_rate and warmup_ratio (or warmup_steps) in "
                     "TrainingArguments."},
        literature=_CS231N,
        example="likely too large a step: the optimizer moves the median layer by 0.21 of "
                "its norm (‖Δw‖/‖w‖; about 1e-3 is usual), up to 0.5 at fc2",
    ),
    Entry(
        code="grads.stale_weights",
        title="Half-precision weights the update leaves unchanged",
        subject=Subject.LOOP,
        levels=INFO_WARNING,
        severity="a warning from 50 % of the half-precision weights that had a gradient "
                 "(stale_warn), info from 10 % (stale_info).",
        meaning="bfloat16 or float16 weights kept without a float32 master copy move only by "
                "a step of at least half the spacing of the dtype's numbers there (1/512 to "
                "1/256 of the weight in bfloat16). Smaller steps round back to the old "
                "value: the loss stalls with no other sign, since the update ratios stay "
                "ordinary.",
        criterion="With the update ratios, for half-precision parameters only: the weights "
                  "after the update compared with their copy from before it, over the "
                  "elements whose gradient is non-zero; the share left exactly as they were, "
                  "over every half-precision parameter together.",
        fix="keep the weights in float32 and compute in half precision under "
            "torch.autocast (mixed precision: the update lands on float32 weights), or use "
            "an optimizer that keeps a float32 copy of the weights or rounds "
            "stochastically; a larger learning rate only moves the threshold.",
        fixes={"lightning": "Trainer(precision=\"bf16-mixed\") (float32 weights), not "
                            "\"bf16-true\".",
               "hf": "load the model in float32 and set bf16=True in TrainingArguments, "
                     "rather than torch_dtype=torch.bfloat16."},
        literature="Rae et al. 2021, Scaling Language Models: Methods, Analysis & Insights "
                   "from Training Gopher, appendix C.2 (arXiv 2112.11446)",
        example="stale weights: the optimizer step left 83% of the 1,204,224 bfloat16 "
                "weights that had a gradient exactly as they were",
        explains=("grads.update_ratio",),
    ),
    Entry(
        code="grads.idle_forward",
        title="Forwards with gradients that no backward reached",
        subject=Subject.LOOP,
        levels=INFO,
        severity="info: it costs memory and time, not correctness.",
        meaning="Forwards of the model ran with gradients on but no backward reached them: "
                "each built an autograd graph and kept its activations alive until its "
                "output was dropped. The usual cause is an evaluation pass without "
                "torch.no_grad() between training steps.",
        criterion="Forwards with gradients enabled in the step whose graph no backward "
                  "pass (nor torch.autograd.grad) reached; any is reported.",
        fix="run evaluation under `with torch.no_grad():` (or torch.inference_mode()); a "
            "forward kept only for logging can detach its output.",
        example="1 forward(s) of the model in step 3 ran with gradients on, but no backward "
                "reached them",
    ),
    Entry(
        code="grads.unseen_forward",
        title="The gradient watch saw no forward",
        subject=Subject.LOOP,
        levels=WARNING,
        severity="a warning: the step reads as healthy only because nothing was measured.",
        meaning="The parameters got gradients in a sampled step, but no hook on the watched "
                "modules fired in its forward, so nothing per layer was measured. The usual "
                "cause is a torch.compile wrapper made before the watch opened (Dynamo never "
                "runs hooks added later), or a select= that names modules that do not run.",
        criterion="A sampled step with at least one parameter gradient and no module "
                  "record.",
        fix="give torchscope the module that the loop calls: a torch.compile wrapper made "
            "before the watch opened never runs hooks added later (pass the compiled module, "
            "which then runs eagerly while watched); check that `select` names modules that "
            "run.",
        example="the parameters got gradients in step 4, but no watched module's forward "
                "ran through torchscope's hooks: nothing per layer was measured",
    ),
    Entry(
        code="grads.compiled_eager",
        title="Compiled parts ran eagerly under the gradient watch",
        subject=Subject.MEASUREMENT,
        levels=INFO,
        severity="info: a caveat about what the watch measured, not a fault.",
        meaning="torchscope's hooks fire only in eager code, so the model's torch.compile'd "
                "parts ran eagerly while the gradient watch was open: those steps ran at "
                "eager speed and with eager numerics (eager gradients differ from compiled "
                "ones in the last bits).",
        criterion="The watched model holds torch.compile'd modules while the watch is open.",
        fix="to train at compiled speed, open the watch around a stretch of the run only "
            "(its findings cover that stretch).",
        example="the model's compiled parts (blocks) ran eagerly while the gradient watch "
                "was open",
    ),
    Entry(
        code="grads.clipped",
        title="Clipping acts on most steps",
        subject=Subject.LOOP,
        levels=INFO,
        severity="info: often meant early in a large model's training.",
        meaning="Where clipping acts on most steps, max_norm, not the gradient, sets each "
                "update's size, and the learning rate scales a normalised step. Clipping "
                "that cuts spikes now and then stays silent.",
        criterion="Over a watched run with an optimizer, 3 samples or more: the loop shrank "
                  "the gradients it applied (the norm the update used 1 % or more below the "
                  "backward's total) on half the sampled steps or more, by clipped_by = 2× "
                  "or more (median).",
        fix="fine if meant; otherwise set max_norm near the usual total norm so that it cuts "
            "only spikes, and lower the learning rate if the steps are then too large.",
        fixes={"lightning": "set gradient_clip_val in the Trainer near the usual total norm.",
               "hf": "set max_grad_norm in TrainingArguments near the usual total norm (the "
                     "default 1.0 clips most steps of a model whose norm is larger)."},
        literature=_PASCANU,
        example="the loop clipped the gradients on 9 of 10 sampled steps, by 4.2× (median: a "
                "total norm of 4.2 applied as 1)",
        explains=("grads.update_ratio",),
    ),
    Entry(
        code="grads.no_step",
        title="The watched optimizer never stepped",
        subject=Subject.LOOP,
        levels=WARNING,
        severity="a warning: no step was counted, so the watch sampled nothing.",
        meaning="A watch or monitor given optimizer= saw two or more backward passes but that "
                "optimizer's step() never ran: the loop steps another optimizer (SAM's "
                "base_optimizer, a wrapper's inner one) or updates the weights by hand.",
        criterion="step_by is the optimizer, no step was counted, and 2 or more backward "
                  "passes ran.",
        fix="pass the optimizer whose step() the loop calls (a wrapper's inner one: SAM's "
            "base_optimizer), or manual=True and end_step() where each step's gradients are "
            "final.",
        example="12 backward passes ran but the optimizer given (SAM) never stepped",
    ),
    Entry(
        code="grads.not_zeroed",
        title="Gradients never zeroed between steps",
        subject=Subject.LOOP,
        levels=WARNING,
        severity="always a warning: each update uses the sum of every gradient so far.",
        meaning="Every backward since the last step() accumulated into the same .grad "
                "tensors, which nothing set to None, replaced or zeroed: each update uses "
                "the sum of every gradient since the loop began, and the total norm grows "
                "step after step.",
        criterion="Read from the gradients' tensors and version counters at each backward's "
                  "end (no device work): an optimizer step whose gradients still hold the "
                  "previous step's. Accumulation over micro-batches with a zeroing after "
                  "each step(), zero_grad(set_to_none=False), model.zero_grad() and LBFGS's "
                  "closure are not it.",
        fix="call optimizer.zero_grad() once per step (before backward, or after step()); "
            "to accumulate over micro-batches, zero after each step(), not after each "
            "backward.",
        fixes={"lightning": "Lightning zeroes the gradients itself under automatic "
                            "optimization; with self.automatic_optimization = False, call "
                            "opt.zero_grad() in training_step after opt.step().",
               "hf": "the Trainer zeroes the gradients after each optimizer step; a "
                     "training_step or inner-loop override must keep model.zero_grad()."},
        example="the gradients were never zeroed between optimizer steps: 9 of 10 steps "
                "(from step 1) updated with the sum of every earlier step's gradient too",
        explains=("grads.exploding", "grads.update_ratio", "grads.clipped", "run.grad_grew",
                  "run.weight_scale", "run.activation_drift", "run.dead_units",
                  "run.loss_spike"),
    ),
    Entry(
        code="grads.cleared_before_step",
        title="Gradients cleared between backward and step",
        subject=Subject.LOOP,
        levels=WARNING,
        severity="always a warning: the updates use no gradient, and the model never learns.",
        meaning="optimizer.zero_grad() ran between loss.backward() and optimizer.step(): "
                "every update uses no gradient.",
        criterion="Set to None: at the optimizer's step every evidence parameter that had a "
                  "gradient at the backward's end has none (metadata, each step). Zeroed in "
                  "place: on sampled steps the norm the update used is 0 while the "
                  "backward's total is not.",
        fix="zero the gradients before the forward (optimizer.zero_grad() at the top of the "
            "loop) or after optimizer.step(), never between loss.backward() and step().",
        example="the loop cleared the gradients between the backward and the optimizer's "
                "step on 10 of 10 steps (from step 0): those updates used no gradient",
        explains=("grads.update_ratio", "grads.not_zeroed"),
    ),
    Entry(
        code="grads.not_optimized",
        title="Parameters that no optimizer steps",
        subject=Subject.LOOP,
        levels=WARNING,
        severity="always a warning: they never train.",
        meaning="Trainable parameters get gradients but no optimizer steps them: a layer "
                "added after the optimizer was built, an optimizer built from part of the "
                "model or from a copy. They never train, and the optimizer's zero_grad() "
                "never clears them, so their gradients pile up.",
        criterion="At each step of the watched optimizer, where it does not hold the whole "
                  "model: the other parameters with a gradient that no optimizer in the "
                  "process stepped while the watch was open (torch's global optimizer "
                  "step hook), and whose values the loop did not change in place itself.",
        fix="build the optimizer from model.parameters() once the model is complete (a "
            "layer added after the optimizer was built is not in it), or add them with "
            "optimizer.add_param_group({'params': [...]}); freeze them with "
            "requires_grad_(False) if they are not meant to train.",
        fixes={"lightning": "build the optimizer in configure_optimizers from "
                            "self.parameters(), after every layer exists.",
               "hf": "let the Trainer build the optimizer, or build the one passed as "
                     "optimizers=(opt, sched) from the finished model's parameters."},
        example="2 parameter(s) get gradients that no optimizer steps (head.weight, "
                "head.bias): they never train",
        explains=("run.grad_grew",),
    ),
    Entry(
        code="grads.no_update",
        title="Backward passes that train none of the model's parameters",
        subject=Subject.LOOP,
        levels=WARNING,
        severity="a warning: nothing was sampled, so no other finding could be made.",
        meaning="Two or more backward passes ran and none added to a gradient of the watched "
                "model's own parameters: the loop trains other tensors (torch.func's "
                "functional_call on copies of the parameters trains the copies) or only "
                "calls torch.autograd.grad.",
        criterion="No step, and 2 or more passes that left every parameter's .grad "
                  "unchanged.",
        fix="watch the module whose parameters the loop trains; with torch.func, "
            "functional_call on copies of the parameters trains the copies, not the "
            "module's parameters.",
        example="8 backward passes ran but none added to a gradient of the model's own "
                "parameters",
    ),
)
