"""HTTP handlers of the Files and Batch APIs (``/v1/files``, ``/v1/batches``)."""
from __future__ import annotations

from starlette.datastructures import UploadFile
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from specprefill_server.errors import APIError, not_found
from specprefill_server.apis.openai.types import BatchCreateRequest
from specprefill_server.parse import parse
from specprefill_server.runner import JobRunner
from specprefill_server.state import read_json, state


def _limit(request: Request, default: int = 20, most: int = 100) -> int:
    raw = request.query_params.get("limit", str(default))
    if not raw.isdigit() or not 1 <= int(raw) <= most:
        raise APIError(400, f"limit: {raw!r:.20} is not a number in 1..{most}", param="limit")
    return int(raw)


async def upload_file(request: Request) -> Response:
    """``POST /v1/files`` (multipart: ``file`` and ``purpose=batch``)."""
    svc = state(request)
    most = svc.settings.max_upload_bytes
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > most + 64 * 1024:  # room for the multipart framing
        raise APIError(413, f"file: larger than max_upload_bytes ({most})", param="file",
                       code="file_too_large")
    form = await request.form(max_files=1, max_fields=8)
    try:
        upload, purpose = form.get("file"), form.get("purpose")
        if purpose != "batch":
            raise APIError(400, f"purpose: {purpose!r:.40} is not supported (only 'batch')", param="purpose")
        if not isinstance(upload, UploadFile):
            raise APIError(400, "file: missing (send it as a multipart file field)", param="file")
        content = await upload.read(most + 1)
        if len(content) > most:
            raise APIError(413, f"file: larger than max_upload_bytes ({most})", param="file",
                           code="file_too_large")
        try:
            content.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise APIError(400, f"file: not UTF-8 text (byte {exc.start})", param="file") from None
        meta = await svc.runner.call(svc.batches.store.put_file, content,
                                     filename=upload.filename or "upload.jsonl", purpose=purpose)
    finally:
        await form.close()
    return JSONResponse(meta)


async def list_files(request: Request) -> Response:
    svc = state(request)
    files = await svc.runner.call(svc.batches.store.list_files, _limit(request, 100, 10000))
    return JSONResponse({"object": "list", "data": files, "has_more": False})


async def _file_meta(runner: JobRunner, store, file_id: str) -> dict:
    meta = await runner.call(store.file, file_id)
    if meta is None:
        raise not_found("file", file_id, "file_id")
    return meta


async def get_file(request: Request) -> Response:
    svc = state(request)
    return JSONResponse(await _file_meta(svc.runner, svc.batches.store, request.path_params["file_id"]))


async def file_content(request: Request) -> Response:
    svc = state(request)
    file_id = request.path_params["file_id"]
    content = await svc.runner.call(svc.batches.store.file_content, file_id)
    if content is None:
        raise not_found("file", file_id, "file_id")
    return Response(content, media_type="application/jsonl")


async def delete_file(request: Request) -> Response:
    svc = state(request)
    file_id = request.path_params["file_id"]
    if not await svc.runner.call(svc.batches.store.delete_file, file_id):
        raise not_found("file", file_id, "file_id")
    return JSONResponse({"id": file_id, "object": "file", "deleted": True})


async def create_batch(request: Request) -> Response:
    svc = state(request)
    req = parse(BatchCreateRequest, await read_json(request))
    await svc.runner.call(svc.runner.check_capacity)
    return JSONResponse(await svc.runner.call(svc.batches.create, req))


async def list_batches(request: Request) -> Response:
    svc = state(request)
    limit = _limit(request)
    batches = await svc.runner.call(svc.batches.store.list_batches, limit + 1,
                                    request.query_params.get("after"))
    page = batches[:limit]
    return JSONResponse({"object": "list", "data": page, "has_more": len(batches) > limit,
                         "first_id": page[0]["id"] if page else None,
                         "last_id": page[-1]["id"] if page else None})


async def get_batch(request: Request) -> Response:
    svc = state(request)
    return JSONResponse(await svc.runner.call(svc.batches.get, request.path_params["batch_id"]))


async def cancel_batch(request: Request) -> Response:
    svc = state(request)
    return JSONResponse(await svc.runner.call(svc.batches.cancel, request.path_params["batch_id"]))
