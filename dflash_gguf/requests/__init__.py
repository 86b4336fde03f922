"""The request surface every front door shares: ``dflash_gguf.Llama``, :class:`dflash_gguf.batch.BatchLlama`
and the server (its one-at-a-time route and its ``--parallel`` slots).

* :mod:`.defaults`: llama_cpp.Llama's sampling defaults per entry point (completion, chat), the one table;
* :mod:`.served`: what DFlash serves (a generation on the ``Llama``, a request in the server's slots) and
  why the rest takes llama_cpp's plain path;
* :mod:`.stops`: stop strings over a request's tokens; :mod:`.stopping`: stopping criteria that look only
  at token ids (llama_cpp's end-of-turn criterion, :class:`.stopping.StopOnTokens`), which DFlash serves exactly;
* :mod:`.prompts`: a chat request's prompt and stop strings, as llama_cpp's chat handlers build them;
* :mod:`.responses`: the shapes of an answer: finish reason, usage, the ``dflash`` object, completion
  bodies and stream chunks (OpenAI's, as llama_cpp gives them).
* :mod:`.logprobs`: generated tokens' log-probabilities from the engine's rows, in llama_cpp's formats;
* :mod:`.calls`: what one call of ``dflash_gguf.Llama`` carries through llama_cpp's entry points.

Nothing is imported here: the decoding engine reads the defaults (:class:`dflash_gguf.decoding.sampling.SamplingParams`)
without loading the rest.
"""
