"""The catalogue's `run.*` entries: what `torchscope.monitoring` says about a whole run."""

from __future__ import annotations

from torchscope.catalogue._base import ERROR, INFO, INFO_WARNING, WARNING
from torchscope.findings import Entry, Subject

_UPDATE_RATIO = ("CS231n, 'Neural Networks Part 3: babysitting the learning process' "
                 "(update-to-weight ratio about 1e-3)")

ENTRIES: tuple[Entry, ...] = (
    Entry(
        code="run.nonfinite",
        title="NaN/Inf appeared during the run",
        subject=Subject.MODEL,
        levels=ERROR,
        severity="always an error: every update after the first non-finite gradient or loss "
                 "is lost.",
        meaning="A gradient element, a loss or a sampled forward's output held NaN or Inf. "
                "From that step on the optimizer writes NaN into the weights (unless a "
                "GradScaler skips the step), and the run trains no more.",
        criterion="Every step, on the device, whether any gradient element is non-finite "
                  "(an infinity norm per gradient: a float32 norm that overflows while every "
                  "element is finite is run.grad_norm_overflow instead). The onset is the "
                  "first such step; the first sampled forward that held NaN/Inf is traced to "
                  "the module that produced it from finite inputs.",
        fix="the first step is the one to look at: rerun up to it with "
            "torch.autograd.detect_anomaly(), guard log/div/sqrt with an eps, and check for "
            "fp16 overflow (bf16 or a GradScaler) and a learning rate that is too high",
        example="NaN/Inf first produced by blocks.3.attn (Attention) at step 7",
        explains=("grads.nonfinite", "activations.nonfinite", "grads.nonfinite_update"),
    ),
    Entry(
        code="run.grad_norm_overflow",
        title="Gradient norm beyond float32's range",
        subject=Subject.MODEL,
        levels=WARNING,
        severity="a warning: no element is NaN/Inf yet, but gradients this large leave "
                 "float32 soon, and a clip by norm divides by an infinite norm.",
        meaning="A float32 sum of squares overflows once an element passes about 1.8e19, "
                "although every element is finite. The norms read as Inf; the gradients "
                "themselves are finite but enormous, as in a deep ReLU network whose "
                "activations grow layer by layer.",
        criterion="A sampled step's gradient norm is Inf while the every-step check of the "
                  "gradients' elements (an infinity norm, which cannot overflow) found none "
                  "non-finite.",
        fix="the gradients grow far too large: check the initialisation (He/Kaiming for "
            "ReLU), add normalisation between layers, lower the learning rate, and clip "
            "gradients (clip_grad_norm_ computes its norm in the gradients' dtype: "
            "pass foreach=False or scale first if it returns inf)",
        example="gradient norm beyond float32's range at step 0 (43 parameters' norms "
                "overflow; largest element finite)",
        explains=("grads.nonfinite", "grads.exploding"),
    ),
    Entry(
        code="run.graph_cut",
        title="Trainable layers cut off from the loss",
        subject=Subject.MODEL,
        levels=WARNING,
        severity="a warning: the layers never learn, though they run and are trainable.",
        meaning="Trainable modules ran in the forward but no gradient reached them, while "
                "a module the forward calls after them got one: the loss sees their output "
                "only through a tensor cut from the autograd graph, by a stray .detach(), "
                ".data, a round trip through .item() or numpy, or a torch.no_grad() block.",
        criterion="In the last sampled step, trainable parameters without a gradient whose "
                  "module ran (the loss did not reach it, or it ran under no_grad), and a "
                  "module later in the forward's call order with a gradient. The finding "
                  "names the last cut module and the first one after it that learns.",
        fix="find the .detach() or torch.no_grad() between the two modules in the forward "
            "and remove it; if the layers are meant to stay fixed, freeze them "
            "(requires_grad_(False))",
        example="the graph is cut after blocks.1.0: 4 trainable parameter(s) in 2 "
                "module(s) (blocks.0.0, blocks.1.0) ran in the forward but got no gradient "
                "at step 27, while blocks.2.0, which the forward calls after them, got one",
        explains=("grads.unreached",),
    ),
    Entry(
        code="run.accumulation_undivided",
        title="Gradient accumulation without dividing the loss",
        subject=Subject.LOOP,
        levels=INFO_WARNING,
        severity="a warning where the gradient at the model's output shows each "
                 "micro-batch's loss undivided; info where the run accumulates but its "
                 "output is no softmax cross-entropy's scores, so the data cannot tell.",
        meaning="With k micro-batches per step, a mean loss must be divided by k before each "
                "backward; otherwise the gradient, and the logged loss, are k times the "
                "mean's, and the learning rate acts k times larger. A recurring fault "
                "(transformers #35438, #37766; LlamaFactory #7443).",
        criterion="For a softmax cross-entropy at the model's output, ∂loss/∂z = s (softmax(z)"
                  " - onehot): s is read at sampled steps as the ratio of the gradient to "
                  "softmax(z) off the target (one number, spread within 1%), times the "
                  "counted rows. A warning where that factor is 1 (within 5%) while the "
                  "step accumulates k >= 2 backward passes; a factor of 1/k is a divided "
                  "loss. Plain loops only: Lightning and the HF Trainer divide themselves.",
        fix="divide each micro-batch's loss by the number of micro-batches before its "
            "backward",
        literature="transformers PR #34191 and the Hugging Face blog post on gradient "
                   "accumulation (2024)",
        example="each of the 4 micro-batches' losses is its own mean, not divided by 4: the "
                "update uses 4× the mean gradient (∂loss/∂scores × counted rows reads 1.000)",
    ),
    Entry(
        code="run.loss_spike",
        title="A loss spike",
        subject=Subject.MODEL,
        levels=WARNING,
        severity="a warning: a step's loss jumped 2x or more above the recent median (and 8 "
                 "median absolute deviations), or its largest gradient 10x.",
        meaning="A loss that jumps far above where it was, often days into a run, is the "
                "usual start of a divergence; between two samples it would go unseen. The "
                "layer whose gradient rose first in the steps before it says where the "
                "instability starts: in transformers, an attention's query/key (attention-"
                "logit growth) or the output layer (output-logit divergence).",
        criterion="A flight recorder holds every step's loss (where the model returns it or "
                  "it is handed to check_loss; else the largest per-parameter gradient "
                  "magnitude) and per-parameter gradient magnitudes for the last "
                  "max(16, every + 1) steps on the device, read at each sample. Against "
                  "the median of the 20 steps before it (at least 5), a loss at 2x and 8 "
                  "median absolute deviations above it is a spike, its rise starting at the "
                  "first step at 1.5x; a gradient magnitude at 10x, rising from 3x. The layer "
                  "that moved first is the one whose gradient passed 3x its own earlier "
                  "median first. A rise over more than 5 steps is a growth, not a spike; one "
                  "spike per 20 steps (momentum carries one a few steps).",
        fix="lower the learning rate or lengthen the warm-up, and clip gradients",
        literature="Wortsman et al. 2023, Small-scale proxies for large-scale Transformer "
                   "training instabilities (arXiv 2309.14322)",
        example="the loss spiked over steps 4–7: 3.9e+05 at step 7, 2e+04× the recent "
                "median (19.8); the first gradient to rise was blocks.3.attn.q_proj.weight's",
    ),
    Entry(
        code="run.grad_fell",
        title="A layer's gradient fell far more than the model's",
        subject=Subject.MODEL,
        levels=INFO_WARNING,
        severity="a warning only where the layer's weight matrices' update ratio "
                 "‖Δw‖/‖w‖ ended far (10x) below the model's median for at least the last "
                 "samples, or where no update ratio was measured and their own gradient fell "
                 "10x more than the median layer's; info for the whole model's gradients "
                 "falling together (convergence) and for falls a normalisation after the "
                 "layer explains.",
        meaning="Every gradient shrinks as a model converges; a layer whose gradient falls "
                "far more than the rest may stop learning. Whether it does is the update "
                "the optimizer gives it against its weights: under Adam a fallen gradient "
                "still moves a weight by about the learning rate. Biases and norm gains are "
                "judged apart: their gradients are sums over the batch, on another scale.",
        criterion="Median of the first and last tenth of the samples (at least 4), per layer, "
                  "over its weight matrices only (2+ dimensions): a fall of 10x that is also "
                  "10x the median layer's. A warning needs the layer's update ratio at the "
                  "end 10x below the model's median update ratio over the same samples "
                  "(where measured).",
        fix="the layer stops learning while the rest of the model does: look for saturating "
            "activations or dying units around it, and check its learning rate and weight "
            "decay",
        literature=_UPDATE_RATIO,
        example="encoder.3.fc's gradient fell 87× between step 0 and step 190, 40× more "
                "than the median layer's; its update ratio 2.1e-6 is 400× below the "
                "model's median (8.8e-4)",
    ),
    Entry(
        code="run.grad_grew",
        title="Gradients grew over the run",
        subject=Subject.MODEL,
        levels=INFO_WARNING,
        severity="a warning where the model's total gradient norm grew with it; info where "
                 "one layer's gradient grew while the total fell (a layer gaining "
                 "direction, a layer scale growing from 1e-6).",
        meaning="Gradients that grow over a run, with the total, drive ever larger updates "
                "and end in divergence.",
        criterion="Median of the first and last tenth of the samples: a layer's gradient "
                  "that grew 10x and 10x more than the median layer's, or the median layer's "
                  "own growth of 10x.",
        fix="clip gradients (clip_grad_norm_), lower the learning rate, or normalise around "
            "the layer",
        example="the median layer's gradient grew 40× between step 0 and step 60",
    ),
    Entry(
        code="run.weight_scale",
        title="The whole model's weights grew or shrank",
        subject=Subject.MODEL,
        levels=WARNING,
        severity="a warning: the median layer's weight norm moved 10x or more.",
        meaning="Healthy runs move the median layer's weight norm by at most 2x in a few "
                "hundred steps. Weights that grow 10x are carried far from their scale by "
                "too large updates; weights that shrink 10x are pulled to zero by weight "
                "decay or a penalty.",
        criterion="The median over layers of (last sample's weight norm / first sample's), "
                  "with at least 4 samples and 3 layers: 10x or more either way; dated at "
                  "the first sample whose median ratio passed 10x.",
        fix="lower the learning rate and warm it up",
        explains=("run.activation_drift", "run.grad_grew", "run.dead_units",
                  "activations.large", "activations.scale_drift", "grads.update_ratio",
                  "run.loss_spike", "run.nonfinite", "run.grad_norm_overflow",
                  "grads.exploding", "grads.nonfinite", "activations.near_overflow"),
        example="the median layer's weights grew 26× between step 0 and step 150",
    ),
    Entry(
        code="run.activation_drift",
        title="Activation scale drifted",
        subject=Subject.MODEL,
        levels=INFO_WARNING,
        severity="a warning at 100x or more; info from 10x.",
        meaning="A layer's output standard deviation that moves 10-100x over a run changes "
                "what every later layer sees; the whole model drifting together is a "
                "diverging run.",
        criterion="Median of the first and last tenth of the samples of each layer's output "
                  "std; when the median layer drifted 10x, one finding for the model and a "
                  "layer only where it went 10x further; dated at the first sample past the "
                  "line. An attention's query or key projection growing is named as "
                  "attention-logit growth.",
        literature="Wortsman et al. 2023, Small-scale proxies for large-scale Transformer "
                   "training instabilities (arXiv 2309.14322); Dehghani et al. 2023, Scaling "
                   "Vision Transformers to 22 Billion Parameters (arXiv 2302.05442)",
        fix="activations that drift this far change what every later layer sees: check the "
            "learning rate of the layers before it, or normalise (LayerNorm/BatchNorm)",
        example="the median layer's output std grew 310× between step 0 and step 30",
    ),
    Entry(
        code="run.dead_units",
        title="Units died during the run",
        subject=Subject.MODEL,
        levels=WARNING,
        severity="a warning where a ReLU-family layer ends with 25% or more dead channels, "
                 "10 points more than at the start (and two channels or more).",
        meaning="A unit whose output is zero for every sample and position gets no gradient "
                "and never recovers: the layer's capacity shrinks as training goes on. One "
                "finding lists every layer, dated at the first sampled step that crossed "
                "the line.",
        criterion="Per layer, the median dead fraction of the last tenth of the samples "
                  "against the first: at 25% or more and grown by 10 points; the onset is "
                  "the first sample at 25% or more.",
        fix="units die during training: lower the learning rate, use LeakyReLU/GELU, or "
            "check the bias of the layer before it",
        explains=("activations.dead_units", "grads.dead"),
        example="dead units grew in 15 layers from step 20 (net.3: 0% at step 0, 62% at "
                "step 20; ...)",
    ),
    Entry(
        code="run.saturated",
        title="Bounded activations saturated during the run",
        subject=Subject.MODEL,
        levels=WARNING,
        severity="a warning where a tanh/sigmoid that feeds a weighted layer grew its "
                 "saturated fraction by 25 points to the capture's warning line.",
        meaning="Saturated units pass almost no gradient back; pre-activations that grow in "
                "training push them into their flat tails.",
        criterion="Median saturated fraction (gradient below 5% of its peak) of the last "
                  "tenth of the samples against the first.",
        fix="its pre-activations grew in training until it saturated: lower the learning "
            "rate, add weight decay, or put a normalisation layer before it",
        example="net.1: the values where its gradient is below 5% of its peak grew from 3% "
                "at step 0 to 71% at step 90",
    ),
    Entry(
        code="run.skipped_steps",
        title="The GradScaler skipped steps",
        subject=Subject.LOOP,
        levels=INFO_WARNING,
        severity="a warning at 5% of the steps or more; info below (the first steps "
                 "calibrate the scale).",
        meaning="A GradScaler skips a step whose gradients held inf/NaN: often, the fp16 "
                "range overflows and those updates are lost.",
        criterion="Steps the scaler skipped over steps completed.",
        fix="many skipped steps mean the fp16 range overflows often: try bf16, a lower "
            "learning rate, or look for the layer whose activations grow",
        example="the GradScaler skipped 12 of 100 steps (12.0%; e.g. step 0, 1, 2)",
    ),
    Entry(
        code="run.stopped",
        title="The run stopped with an exception",
        subject=Subject.LOOP,
        levels=WARNING,
        severity="a warning: the report covers only the steps before it.",
        meaning="An exception ended the training loop inside the monitor.",
        criterion="The monitor's block was left by an exception.",
        fix="",
        example="the run stopped in step 37 (after 37 completed steps): RuntimeError: ...",
    ),
    Entry(
        code="run.dead_experts",
        title="Experts of a mixture of experts never got a token",
        subject=Subject.MODEL,
        levels=WARNING,
        severity="a warning where an expert got no gradient in every one of 5 or more "
                 "sampled steps.",
        meaning="The router collapsed onto the other experts: these never learn.",
        criterion="Per expert, sampled steps in which no gradient reached its slice of the "
                  "fused weight: every one of at least 5.",
        fix="keep the router from collapsing with a load-balancing loss "
            "(output_router_logits=True with router_aux_loss_coef above 0)",
        example="model.layers.0.mlp.experts: 3 of 8 experts (1, 4, 6) got no token in any "
                "of the 12 sampled steps",
    ),
    Entry(
        code="run.eval_mode",
        title="Training steps ran with the model in eval mode",
        subject=Subject.LOOP,
        levels=INFO_WARNING,
        severity="a warning where eval-mode steps followed train-mode ones (a model.eval() "
                 "left in place); info where every step ran so.",
        meaning="In eval mode dropout is off and BatchNorm normalises with running "
                "statistics, which stop updating: the model trains as something else than "
                "what is evaluated.",
        criterion="The model's `training` flag at each step's forward with gradients on, "
                  "where the model has dropout (p > 0) or BatchNorm modules.",
        fix="call model.train() after evaluating, before the next training step",
        fixes={"lightning": "Lightning calls model.train() after validation itself: look "
                            "for a model.eval() or .train(False) in training_step or a hook",
               "hf": "the Trainer calls model.train() in each training step: look for a "
                     "callback or compute_loss override that leaves model.eval() on"},
        example="20 of 30 steps, from step 10, trained with the model in eval mode",
    ),
    Entry(
        code="run.same_batch",
        title="The loop trains on one batch",
        subject=Subject.DATA,
        levels=INFO,
        severity="info: fitting one batch is also a deliberate check of a pipeline.",
        meaning="At every pair of consecutive steps compared, the model got the same input: "
                "a batch drawn once before the loop is trained on at every step.",
        criterion="Each sampled step's first training forward against the next step's, by "
                  "fingerprint (shapes, dtypes, each tensor's sum and L2 norm in float64): "
                  "three pairs or more, all the same.",
        fix="draw a new batch at every step (for x, y in loader: ...)",
        example="the model got the same input at consecutive steps in each of the 5 pairs "
                "compared",
    ),
    Entry(
        code="run.padding_in_loss",
        title="The loss trains on padding",
        subject=Subject.DATA,
        levels=WARNING,
        severity="a warning: the model learns to predict the pad token.",
        meaning="Label positions that the attention mask pads hold a token, not -100, so a "
                "transformers model's loss counts them.",
        criterion="Over the sampled steps, label positions where attention_mask is 0 and "
                  "the label is not -100.",
        fix="set the labels to -100 where attention_mask is 0, or build the batches with "
            "DataCollatorForLanguageModeling(tokenizer, mlm=False)",
        example="the loss trains on padding: 48 of the 64 label positions that the "
                "attention mask pads hold a token",
    ),
    Entry(
        code="run.fp16_unscaled",
        title="float16 autocast without a GradScaler",
        subject=Subject.LOOP,
        levels=WARNING,
        severity="a warning: small gradients round to zero without a sign.",
        meaning="float16 gradients below 6.0e-8 round to zero and those below 6.1e-5 lose "
                "precision; a GradScaler scales the loss so they do not.",
        criterion="Steps whose forward ran under float16 autocast on the model's device, "
                  "with no GradScaler given or seen stepping the optimizer.",
        fix="scale the loss with torch.amp.GradScaler, or autocast to torch.bfloat16",
        fixes={"lightning": "Trainer(precision='16-mixed') scales the loss for you; or "
                            "precision='bf16-mixed'",
               "hf": "TrainingArguments(fp16=True) scales the loss for you; or bf16=True"},
        example="30 of 30 steps ran their forward under float16 autocast with no GradScaler",
    ),
    Entry(
        code="run.compiled_eager",
        title="Compiled parts ran eagerly under the monitor",
        subject=Subject.MEASUREMENT,
        levels=INFO,
        severity="info: a caveat about what the monitor saw.",
        meaning="torchscope's hooks fire only in eager code, so a compiled model runs "
                "eagerly while the monitor is open: its step times are the eager model's.",
        criterion="torch.compile'd modules in the model when the monitor opened.",
        fix="to train at compiled speed, open the monitor around a stretch of the run only",
        example="the model's compiled parts (<root>) ran eagerly while the monitor was open",
    ),
    Entry(
        code="run.loss_unseen",
        title="No loss of the run was seen",
        subject=Subject.MEASUREMENT,
        levels=INFO,
        severity="info: a caveat, the loss's own checks did not run.",
        meaning="The monitor read no loss (the model returned none, none was handed to "
                "check_loss), so whether the loss broadcasts or takes probabilities as "
                "logits was not checked.",
        criterion="No loss the model returned or handed to Monitor.check_loss.",
        fix="hand each step's loss to the monitor before its backward: mon.check_loss(loss)",
        fixes={"hf": "callback.install(trainer) hands each step's loss to the monitor"},
        example="no loss of this run was seen",
    ),
)
