"""The tests' restore oracle: vLLM's own ExampleConnector, matching the longest stored prefix
of a prompt (loaded as ``PrefixExampleConnector`` from ``kvfs.integrations.vllm``)."""

from __future__ import annotations

import os
from typing import Any

import torch


def _example_connector_class() -> type:
    from vllm.distributed.kv_transfer.kv_connector.v1.example_connector import (
        ExampleConnector,
        ExampleConnectorMetadata,
    )

    class PrefixExampleConnector(ExampleConnector):
        """vLLM's ExampleConnector (its own save and inject code, bit for bit), except that
        a request restores the longest block-aligned prefix of its prompt that an earlier
        request stored, not only its whole prompt. The restore oracle of the tests."""

        def _stored_prefix(self, tokens: list[int]) -> int:
            bs = self._block_size
            k = (len(tokens) - 1) // bs * bs  # at least one token left to compute
            while k >= bs:
                if os.path.exists(self._generate_foldername_debug(
                        torch.tensor(tokens[:k]), [], create_folder=False)):
                    return k
                k -= bs
            return 0

        def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int
                                       ) -> tuple[int | None, bool]:
            k = self._stored_prefix(list(request.prompt_token_ids or []))
            self._matched = getattr(self, "_matched", {})
            self._matched[request.request_id] = k
            return max(0, k - num_computed_tokens), False

        def build_connector_meta(self, scheduler_output: Any) -> Any:
            meta = ExampleConnectorMetadata()
            matched = getattr(self, "_matched", {})
            for new in scheduler_output.scheduled_new_reqs:
                tokens = list(new.prompt_token_ids or [])
                if new.req_id in self._requests_need_load:
                    k = matched[new.req_id]
                    # make_meta keeps (len - 1) // bs * bs tokens: pass one more.
                    meta.add_request(tokens[:k + 1], new.block_ids[0], self._block_size,
                                     is_store=False, mm_hashes=[])
                elif not self._found_match_for_prompt(tokens, []):
                    meta.add_request(tokens, new.block_ids[0], self._block_size,
                                     is_store=True, mm_hashes=[])
            self._requests_need_load.clear()
            return meta

    return PrefixExampleConnector

