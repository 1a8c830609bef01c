"""Named exceptions of the generator.

Every argument is checked before it touches the generator (`Job()`, `SamplingSettings()`, `enqueue()`, the
generator's constructor), so a rejected job never disturbs the jobs already running. Each error subclasses
`ValueError`, so existing `except ValueError` code keeps working; the `*TypeError` variants, raised when an argument
has the wrong type, also subclass `TypeError`. Messages name the argument, the value received and what is allowed.

Failures that validation cannot foresee and that belong to one job (a text-decoding error, a failing callback) do
not raise: they end that job alone with a final result whose `eos_reason` is `"error"` (see `paged.host.generator`).
"""

from models.errors import NonFiniteWeightError


class GeneratorError(Exception):
    """Base class for generator errors."""


class InvalidSettingsError(GeneratorError, ValueError):
    """A sampling setting is out of range or of the wrong kind (e.g. negative temperature, top_p outside (0, 1])."""


class InvalidSettingsTypeError(InvalidSettingsError, TypeError):
    """A sampling setting has the wrong type (e.g. a string temperature, a float top_k)."""


class InvalidJobError(GeneratorError, ValueError):
    """A job's inputs are malformed: empty prompt, non-integer or out-of-vocabulary ids, bad stop conditions, ..."""


class InvalidJobTypeError(InvalidJobError, TypeError):
    """A job argument has the wrong type (e.g. `stop_conditions=7`, `max_new_tokens="10"`)."""


class JobTooLargeError(GeneratorError, ValueError):
    """The job can never fit: prompt + max_new_tokens exceeds max_seq_len, or needs more pages than the cache has."""


class InvalidConfigError(GeneratorError, ValueError):
    """An engine or generator setting is invalid (e.g. `max_prefill_rows=0`, a model given as a string)."""


class InvalidConfigTypeError(InvalidConfigError, TypeError):
    """An engine or generator setting has the wrong type (e.g. `max_batch_size=2.5`)."""


class NonFiniteAdapterError(InvalidConfigError, NonFiniteWeightError):
    """`DynamicGenerator.load_lora` was given an adapter with a NaN or infinity in a weight (`tensor` names it). Also
    a `models.errors.NonFiniteWeightError`, which `models.lora.load_lora` raises for the same file."""


class StepError(GeneratorError, RuntimeError):
    """The device step itself failed; the generator is still usable and no results were lost (see `iterate()`)."""


class PolicyError(StepError, InvalidConfigError):
    """A scheduling policy handed back something the scheduler cannot act on (a job to start that is not waiting,
    does not fit or was started already, a victim that is not running, a bad token budget) or raised in one of its
    hooks. The message names the policy and the hook. Nothing was changed by the rejected request, so, like any
    `StepError`, it leaves the generator usable (it is also an `InvalidConfigError`: the policy needs fixing)."""


class JobFailure(GeneratorError, RuntimeError):
    """A failure that belongs to one job while it runs (every token banned at a position, a text-decoding error, ...).
    Never raised to the caller: the generator ends that job alone with a final result whose `eos_reason` is
    `"error"` and whose `error` says what happened."""


class UnsupportedFeatureError(GeneratorError, NotImplementedError):
    """A setting or input that ExLlamaV2 has and this project does not implement (yet); never silently ignored."""
