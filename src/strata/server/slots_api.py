"""llama.cpp's slot endpoints: `GET /props` (the server's settings) and `GET /slots` (each
slot's state), answered on the request thread from a snapshot of the scheduler
(`Scheduler.slot_states`), the engine thread never waited for; and `POST /slots/ID?action=
save|restore|erase` (`--slot-save-path`), run on the engine thread between windows
(engine/slot_files.py)."""
from __future__ import annotations

import logging

from flask import jsonify, request

import strata
from strata.engine.sampling import SamplingParams
from strata.engine.scheduler import SlotState
from strata.engine.slot_files import SlotFiles
from strata.errors import ConfigError, RequestError, StrataError
from strata.server.api_error import ApiError, missing
from strata.server.generation import GenerationRoutes
from strata.server.schema import parse_json_body

# llama.cpp's seed for "none given" (LLAMA_DEFAULT_SEED): each request draws its own
RANDOM_SEED = 0xFFFFFFFF
# llama.cpp's repeat_last_n when a request gives none: the repetition penalty looks back over
# the last 64 tokens (/completion, /infill; the OpenAI endpoints' covers every token)
LLAMA_REPEAT_LAST_N = 64
_OFF_VALUES = ("", "0", "false")
log = logging.getLogger("strata.server")


def sampling_fields(params: SamplingParams, max_tokens: int) -> dict:
    """`params` under llama.cpp's names (only those Strata's sampler has); `max_tokens` -1:
    up to the room the context leaves, as llama.cpp's n_predict -1."""
    return {
        "n_predict": max_tokens, "max_tokens": max_tokens,
        "seed": RANDOM_SEED if params.seed is None else params.seed,
        "temperature": params.temperature, "top_k": params.top_k, "top_p": params.top_p,
        "min_p": params.min_p, "repeat_penalty": params.repetition_penalty,
        "repeat_last_n": params.repeat_last_n,
        "presence_penalty": params.presence_penalty,
        "frequency_penalty": params.frequency_penalty,
        "stop": list(params.stop), "ignore_eos": params.ignore_eos,
        "logit_bias": [{"bias": bias, "token": token}
                       for token, bias in sorted(params.logit_bias.items())],
        "n_probs": params.logprobs or 0,  # alternatives per token with their logprobs
    }


def slot_fields(slot: SlotState, n_ctx: int, is_speculative: bool) -> dict:
    """One slot in llama.cpp's fields, and `n_kv_tokens` (Strata's: the tokens its KV holds,
    which an idle slot keeps for the conversation's next turn). A busy slot adds its
    request's prompt counts, parameters and progress."""
    out = {"id": slot.index, "id_task": -1 if slot.request_id is None else slot.request_id,
           "n_ctx": n_ctx, "speculative": is_speculative, "is_processing": slot.is_busy,
           "n_kv_tokens": slot.num_tokens}
    if not slot.is_busy:
        return out
    max_tokens = slot.params.max_tokens
    out.update({
        "n_prompt_tokens": slot.num_prompt_tokens,
        "n_prompt_tokens_processed": slot.num_read_tokens - slot.num_cached_tokens,
        "n_prompt_tokens_cache": slot.num_cached_tokens,
        "params": sampling_fields(slot.params, max_tokens),
        # a finished request leaves its slot at once: a busy slot has a next token to come.
        # An array of one object, as llama.cpp's (its clients read next_token[0])
        "next_token": [{"has_next_token": True,
                        "n_remain": max_tokens - slot.num_generated_tokens,
                        "n_decoded": slot.num_generated_tokens}],
    })
    return out


class SlotsRoutes(GenerationRoutes):
    _files: SlotFiles | None = None

    def props(self):
        engine = self._engine()
        state = self.state
        template = engine.chat_template
        return jsonify({
            "default_generation_settings": {
                "id": 0, "id_task": -1, "n_ctx": engine.n_ctx,
                "speculative": engine.scheduler.drafts.is_on, "is_processing": False,
                # what /completion and /infill sample with when a request sets nothing
                "params": sampling_fields(SamplingParams(repeat_last_n=LLAMA_REPEAT_LAST_N),
                                          -1),
            },
            "total_slots": engine.scheduler.table.num_slots,
            "model_alias": state.model_id,
            "model_path": str(engine.config.model_path),
            "chat_template": template.source,  # the GGUF's, else the shipped ChatML one
            "bos_token": template.bos_token,  # "" where the tokenizer has none
            "eos_token": template.eos_token,
            "modalities": {"vision": False, "audio": False},
            "endpoint_slots": state.config.is_slots_endpoint_on,
            "build_info": f"strata {strata.__version__}",
        })

    def slots(self):
        if not self.state.config.is_slots_endpoint_on:
            raise ApiError(501, "GET /slots is off: the server was started with --no-slots; "
                           "restart it without that option to read the slots' state.",
                           code="slots_endpoint_disabled", type="not_supported_error")
        engine = self._engine()
        scheduler = engine.scheduler
        slots = scheduler.slot_states()
        # as llama.cpp: a value turns it on (Strata reads 0 and false as off)
        fail_on_no_slot = request.args.get("fail_on_no_slot", "").strip().lower()
        if fail_on_no_slot not in _OFF_VALUES and all(s.is_busy for s in slots):
            raise ApiError(503, f"No slot available: all {len(slots)} slots are busy; retry "
                           "when one is free (a generating request queues for one anyway).",
                           code="no_slot_available", type="unavailable_error")
        return jsonify([slot_fields(s, engine.n_ctx, scheduler.drafts.is_on)
                        for s in slots])

    def slot_action(self, id_slot: int):
        """llama.cpp's `POST /slots/ID?action=save|restore|erase` (`filename` in the body for
        save and restore)."""
        folder = self.state.config.slot_save_path
        if folder is None:
            raise ApiError(501, "Slot actions are off: start the server with --slot-save-path "
                           "DIR to save and restore slots' KV as files in DIR.",
                           code="slot_actions_disabled", type="not_supported_error")
        action = request.args.get("action", "")
        if action not in ("save", "restore", "erase"):
            raise ApiError(400, f"Unknown slot action {action!r}; give ?action=save, restore "
                           "or erase.", param="action", code="invalid_action")
        body = parse_json_body(request.get_data()) if action != "erase" else {}
        filename = body.get("filename")
        if action != "erase" and filename is None:
            raise missing("filename", "the slot file's name in --slot-save-path")
        engine = self._engine()
        if action == "erase":  # no file: the folder is not needed

            def run(_engine):
                return {"id_slot": id_slot, "n_erased": _engine.scheduler.erase_slot(id_slot)}
        else:
            files = self._slot_files(folder, engine)

            def run(_engine):
                return getattr(files, action)(id_slot, filename)

        try:
            return jsonify(self.state.worker.call(run))
        except RequestError as e:
            busy = "processing a request" in str(e)
            raise ApiError(409 if busy else 400, str(e),
                           code="slot_busy" if busy else "invalid_request") from e
        except StrataError as e:  # the server's side (the folder gone, a full disk): named
            raise ApiError(500, str(e), code="server_error") from e

    def _slot_files(self, folder: str, engine) -> SlotFiles:
        """The engine's slot files in `folder`; a folder gone since the start is the
        server's fault, named (it was a bare 500 "internal_error")."""
        if self._files is None or self._files.engine is not engine:
            try:
                self._files = SlotFiles(folder, engine)
            except ConfigError as e:
                # the operator's log names the folder; a client is not told the server's paths
                log.error("slot action refused: %s (it was there when the server started)", e)
                raise ApiError(500, "--slot-save-path is not a folder any more (it was there "
                               "when the server started); the server's log names it.",
                               code="server_error") from e
        return self._files
