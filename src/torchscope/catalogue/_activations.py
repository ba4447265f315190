"""The catalogue's `activations.*` entries: what `torchscope.capture` says about a forward's
activations (docs/diagnosis.md gives each criterion in full)."""

from __future__ import annotations

from torchscope.catalogue._base import ERROR, INFO, INFO_WARNING, WARNING
from torchscope.findings import Entry, Subject

_GLOROT = ("Glorot & Bengio 2010, Understanding the difficulty of training deep feedforward "
           "neural networks (AISTATS)")
_HE = "He et al. 2015, Delving deep into rectifiers (arXiv 1502.01852)"

ENTRIES: tuple[Entry, ...] = (
    Entry(
        code="activations.nonfinite",
        title="A module makes the first NaN/Inf of the forward",
        subject=Subject.MODEL,
        levels=ERROR,
        severity="always an error: the loss and every gradient inherit it.",
        meaning="The module that produces the first NaN/Inf of the forward from finite "
                "inputs, with how many later modules carry it on: the place to guard (a log "
                "or sqrt at 0, a division by zero, float16 overflow).",
        criterion="In the first forward whose outputs held NaN/Inf, the first call (in "
                  "forward order) whose output is non-finite while its inputs were finite "
                  "(NaN and Inf counts read on the device with the statistics).",
        fix="inspect the module's inputs: guard log/div/sqrt with an eps or clamp, and check "
            "for fp16 overflow (run `torchscope capture` with --select on it).",
        example="blocks.3.attn (Attention) produces the first NaN/Inf of the forward from "
                "finite inputs; 12 later module(s) carry it on",
        explains=("grads.nonfinite",),
    ),
    Entry(
        code="activations.nonfinite_between",
        title="NaN/Inf made between captured modules",
        subject=Subject.MODEL,
        levels=ERROR,
        severity="always an error: the loss and every gradient inherit it.",
        meaning="The model's input is finite and no captured module made the NaN/Inf: plain "
                "tensor code in a parent's forward (torch.log(h - 10), a softmax over an "
                "all-masked row) or a module left out of select= made it, between the two "
                "calls named.",
        criterion="The first non-finite forward has no producer among the captured calls, "
                  "the model's inputs were read finite at the forward's start, and the first "
                  "call that takes the NaN/Inf in is named with the call that finished "
                  "before it.",
        fix="look at the plain tensor code between those calls (log, sqrt, division, exp, a "
            "softmax over an all-masked row): guard it with an eps or clamp; or capture with "
            "select= covering any module left out there.",
        example="NaN/Inf first appears after blocks.1 and before blocks.2.norm, in code no "
                "captured module covers (the model's input is finite)",
        explains=("grads.nonfinite",),
    ),
    Entry(
        code="activations.nonfinite_input",
        title="The model's input holds NaN/Inf",
        subject=Subject.DATA,
        levels=ERROR,
        severity="always an error: nothing downstream of it can be finite.",
        meaning="NaN/Inf reaches the model from outside it: the batch itself holds it (or "
                "code before the captured modules made it). The data pipeline is to blame, "
                "not a layer.",
        criterion="The first non-finite forward has no producer among the captured calls, "
                  "and the model's inputs were read non-finite at the forward's start (or "
                  "could not be read).",
        fix="check the data pipeline: torch.isfinite(batch).all() before the forward.",
        example="the model's input already holds NaN/Inf; 14 module(s) carry it",
        explains=("activations.nonfinite", "activations.nonfinite_between",
                  "grads.nonfinite"),
    ),
    Entry(
        code="activations.dead_units",
        title="Dead ReLU units",
        subject=Subject.MODEL,
        levels=INFO_WARNING,
        severity="a warning from 75 % of a layer's units dead on 8 values per unit or more; "
                 "info below (\"possibly a loss of capacity\"), or on fewer values "
                 "(\"may be chance\").",
        meaning="ReLU-family units that are zero for every sample and position pass no "
                "gradient and learn nothing. About half can be silent in a deep ReLU stack "
                "under PyTorch's default init (each unit's sign set by its bias); well "
                "beyond half, the layer is likely dying.",
        criterion="Per unit (dim 1 after a convolution or batch norm, the last dim after a "
                  "linear layer: the neighbouring layers decide), zero for every value; "
                  "dead_warn = 75 % with dead_min_observations = 8 values per unit for a "
                  "warning.",
        fix="lower the learning rate or use LeakyReLU/GELU; check the init and the bias of "
            "the layer before it (Kaiming init keeps a deep ReLU stack's inputs from "
            "shrinking to its biases).",
        literature=_HE + "; Lu et al. 2019, Dying ReLU and initialization (arXiv "
                   "1903.06733); CS231n, 'Neural Networks Part 1'",
        example="features.3 (ReLU): 7 of 8 channels (88%) are zero for every sample and "
                "position",
        explains=("grads.dead", "activations.mostly_zero"),
    ),
    Entry(
        code="activations.mostly_zero",
        title="A ReLU output that is mostly zeros",
        subject=Subject.MODEL,
        levels=WARNING,
        severity="a warning: most of the layer passes no gradient.",
        meaning="A ReLU-family output that is nearly all zeros without whole dead units: "
                "most of its pre-activations are negative, so most of the layer passes no "
                "gradient back.",
        criterion="A ReLU-family output with mostly_zero = 95 % zeros or more and no dead "
                  "unit.",
        fix="check the scale of the layer before it and its bias init.",
        example="encoder.act (ReLU) outputs 97% zeros",
    ),
    Entry(
        code="activations.saturated",
        title="Saturated tanh or sigmoid units",
        subject=Subject.MODEL,
        levels=INFO_WARNING,
        severity="a warning from 50 % of its values in the tails, or 75 % of its units "
                 "there at every sample; info from 25 %, or from any unit there at every "
                 "sample.",
        meaning="A bounded activation whose values sit in its tails, where its local "
                "gradient is below 5 % of its peak, passes almost no gradient back: the "
                "layer before it barely learns.",
        criterion="Tanh: |y| ≥ √0.95 (tanh' = 1 − y²); sigmoid: |2y − 1| ≥ √0.95; softsign: "
                  "|y| ≥ 1 − √0.05; the hard ones at their bounds (counts equal to "
                  "autograd's). saturated_warn = 50 %, saturated_info = 25 %. Judged only "
                  "where a weighted layer follows it (a model's last sigmoid saturates as its "
                  "predictions grow sure).",
        fix="shrink the pre-activations: initialise the layer before it for this "
            "nonlinearity (nn.init.xavier_uniform_ with gain=nn.init.calculate_gain('tanh')), "
            "put a normalisation layer before it, or lower the learning rate.",
        literature=_GLOROT,
        example="hidden.act (Tanh): 66% of its values sit where its gradient is below 5% "
                "of its peak",
        explains=("grads.vanishing",),
    ),
    Entry(
        code="activations.input_scale",
        title="A model input far from unit scale",
        subject=Subject.DATA,
        levels=WARNING,
        severity="a warning: the first layer's default init expects inputs of about unit "
                 "scale.",
        meaning="A Linear or convolution takes the model's input as it is (not a tensor the "
                "model rescaled first) at an RMS far above 1, overall or in one feature: "
                "large pre-activations, saturated units and large gradients in the first "
                "layer follow. 0-255 pixels have an RMS of about 140; a column of ages in "
                "years, about 50.",
        criterion="The input's root mean square, or one feature's (a column, a channel), at "
                  "input_rms = 10 or more, read once per forward at the first weighted layer "
                  "that takes it.",
        fix="normalise the input with the training set's statistics, (x - mean) / std per "
            "feature or channel (for 0-255 pixels, divide by 255 first, then torchvision's "
            "Normalize); large inputs make large pre-activations, saturated units and large "
            "gradients in the first layer.",
        example="fc1 (Linear) takes the model's input as it is, at mean 127 and std 73.6 "
                "(from 0 to 255): its default init expects inputs of about unit scale",
        explains=("activations.saturated", "activations.large"),
    ),
    Entry(
        code="activations.batch_stats",
        title="BatchNorm over too few values",
        subject=Subject.DATA,
        levels=WARNING,
        severity="a warning: the layer passes little of its input on and its gradients "
                 "are large.",
        meaning="A BatchNorm that normalises with the batch's own statistics over very few "
                "values per channel (the batch times the positions): over two values its "
                "outputs are +γ and −γ whatever they were, over n within ±√(n − 1).",
        criterion="Training mode, or track_running_stats=False, with batch_norm_values = 8 "
                  "values per channel or fewer (times the process group's size for a "
                  "SyncBatchNorm).",
        fix="give BatchNorm more values per channel: a larger batch per device (or "
            "nn.SyncBatchNorm across devices), or larger inputs; or replace it with "
            "GroupNorm/LayerNorm; when fine-tuning with small batches, keep BatchNorm in eval "
            "mode.",
        literature="Ioffe & Szegedy 2015, Batch normalization (arXiv 1502.03167)",
        example="resnet.encoder.stages.3.layers.0.shortcut.normalization (BatchNorm2d) "
                "normalises each channel over 4 values (a batch of 4 × 1 positions)",
        explains=("grads.exploding",),
    ),
    Entry(
        code="activations.frozen_batch_norm",
        title="Frozen BatchNorm layers in training mode",
        subject=Subject.LOOP,
        levels=WARNING,
        severity="a warning: the frozen part of the model still changes.",
        meaning="BatchNorm layers whose weights are frozen (requires_grad=False) ran in "
                "training mode: freezing stops their weights, not their running statistics, "
                "which move toward each batch's, and their outputs use each batch's own "
                "statistics. model.train() puts a backbone set to eval once back into "
                "training mode.",
        criterion="A BatchNorm with running statistics, frozen weights, in training mode "
                  "(ActivationRecord.frozen); one finding for all of them.",
        fix="keep them in eval mode after every model.train() (override train() on the "
            "frozen module, or call .eval() on it at each step's start), or replace them "
            "with torchvision.ops.FrozenBatchNorm2d; leave them if adapting their "
            "statistics to the new data is intended.",
        fixes={"lightning": "Lightning calls model.train() at every epoch: set the backbone "
                            "to eval in on_train_epoch_start, or override its train().",
               "hf": "the Trainer calls model.train() at every step: override the frozen "
                     "module's train() to keep it in eval mode."},
        example="20 BatchNorm layer(s) with frozen weights under resnet ran in training mode",
    ),
    Entry(
        code="activations.constant",
        title="An output that does not vary",
        subject=Subject.MODEL,
        levels=INFO_WARNING,
        severity="a warning; info where the module's own parameters are all zero (a "
                 "deliberate zero init) or the constant is a softmax uniform over more than "
                 "one element (usual at init).",
        meaning="An output whose every element is equal carries no information (a saturated "
                "unit, a weight zeroed by mistake, an activation whose input is zero). A "
                "softmax over one element is 1 whatever its scores, which then get no "
                "gradient.",
        criterion="Every element of a finite output equal; attention probabilities are "
                  "told apart (1/N over a last dimension of N), and so is an activation's "
                  "value at 0. Two or more constant warnings of one module type, value and "
                  "fix are one finding.",
        fix="a constant output carries no information: check its input and weights (zero "
            "init? saturated?).",
        example="4 Sigmoid modules (se.0.gate, se.1.gate, ...) output the same value 0.5 "
                "everywhere, their value at 0",
    ),
    Entry(
        code="activations.near_overflow",
        title="A half-precision output near overflow",
        subject=Subject.MODEL,
        levels=WARNING,
        severity="a warning: one more doubling is Inf.",
        meaning="A float16 or bfloat16 output reaches half of its dtype's largest value: "
                "the next larger value overflows to Inf and turns the loss NaN.",
        criterion="|x| ≥ low_precision_headroom = 50 % of the dtype's max.",
        fix="keep this op in float32 (autocast excludes it) or rescale its input.",
        literature="Micikevicius et al. 2018, Mixed precision training (arXiv 1710.03740)",
        example="mlp.fc2 reaches 4.1e+04, 63% of torch.float16's max",
    ),
    Entry(
        code="activations.large",
        title="Large activations",
        subject=Subject.MODEL,
        levels=WARNING,
        severity="a warning: values this large overflow in float16 and slow training.",
        meaning="An output with values of 10⁴ or more; one finding at the first module where "
                "values get that large, with how many later modules carry them.",
        criterion="|x| ≥ large_abs = 1e4 in a finite output that is not already "
                  "activations.near_overflow's (half of a 16-bit dtype's max).",
        fix="normalise the input or add a normalisation layer; large activations overflow "
            "in fp16 and slow training.",
        example="layers.2 (Linear) outputs values up to 3.2e+04; 5 later module(s) too, up "
                "to 8.1e+05",
    ),
    Entry(
        code="activations.scale_drift",
        title="Activation scale drifts across depth",
        subject=Subject.MODEL,
        levels=INFO_WARNING,
        severity="a warning where the drift is steady (a log-linear fit of std against "
                 "depth with R² ≥ 0.75, or only two layers); info otherwise (\"possible "
                 "drift\").",
        meaning="The output standard deviation of the last weighted layer against the "
                "first's: the forward counterpart of vanishing and exploding gradients. "
                "Inits are derived to keep this variance level; normalization gains that "
                "start near zero compound into a collapse.",
        criterion="The ratio of std between the last and first weighted layers (Linear, "
                  "ConvNd; embeddings left out) beyond scale_drift = 100× either way. A "
                  "shrinking drift names the normalization layers between them whose output "
                  "std is below 0.1.",
        fix="check the weight init (kaiming/xavier for the nonlinearity) or add "
            "normalisation; initialise normalization gains to 1.",
        literature=_HE + "; " + _GLOROT,
        example="activation std shrinks 4.7e+33× from stem.conv to classifier over 82 "
                "weighted layers (fit R² 0.97)",
        explains=("grads.vanishing", "grads.exploding", "grads.dead", "activations.constant"),
    ),
    Entry(
        code="activations.unseen_forward",
        title="The activation capture saw no forward",
        subject=Subject.LOOP,
        levels=WARNING,
        severity="a warning: an empty capture reads as a healthy one.",
        meaning="The capture was open but no forward of the watched modules ran through its "
                "hooks, so nothing was recorded. The usual cause is a torch.compile wrapper "
                "made before the capture opened (Dynamo never runs hooks added later), or a "
                "select= that names modules that do not run.",
        criterion="A capture that closes with no forward recorded.",
        fix="give torchscope the module that the loop calls: a torch.compile wrapper made "
            "before the watch opened never runs hooks added later (pass the compiled module, "
            "which then runs eagerly while watched); check that `select` names modules that "
            "run.",
        example="no forward of the watched modules ran through the activation capture's "
                "hooks while it was open: nothing was recorded, which is no sign of health",
    ),
    Entry(
        code="activations.compiled_eager",
        title="Compiled parts ran eagerly under the capture",
        subject=Subject.MEASUREMENT,
        levels=INFO,
        severity="info: a caveat about what the capture measured, not a fault.",
        meaning="torchscope's hooks fire only in eager code, so the model's torch.compile'd "
                "parts ran eagerly while the activation capture was open: at eager speed "
                "and with eager numerics.",
        criterion="The captured model holds torch.compile'd modules while the capture is "
                  "open.",
        fix="to run at compiled speed, open the capture around a stretch of the run only "
            "(its findings cover that stretch).",
        example="the model's compiled parts (encoder) ran eagerly while the activation "
                "capture was open",
    ),
)
