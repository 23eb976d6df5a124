//! OpenAI-compatible HTTP API over the same registry as the gRPC service, for clients and
//! tools that speak only that protocol (and so one worker can be another's remote backend):
//! `GET /v1/models`, `POST /v1/embeddings`, `POST /v1/completions`,
//! `POST /v1/chat/completions` (streamed as server-sent events with `stream: true`,
//! log-probabilities with `logprobs`). Errors use OpenAI's `{"error": {...}}` shape.

use std::sync::Arc;

use axum::Json;
use axum::Router;
use axum::body::Body;
use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use ragcluster_proto::v1::{ChatMessage, EmbedInput, GenerateRequest, GenerateResponse};
use serde_json::{Value, json};
use tokio::sync::mpsc;

use crate::error::ModelError;
use crate::registry::Registry;

/// Accepted connections (after the TLS handshake when the worker serves TLS) for axum.
pub struct TlsListener(pub ragcluster_common::tls::Listener);

impl axum::serve::Listener for TlsListener {
    type Io = ragcluster_common::tls::ServerConn;
    type Addr = std::net::SocketAddr;

    async fn accept(&mut self) -> (Self::Io, Self::Addr) {
        match self.0.next().await {
            Some(c) => c,
            // The accept loop ended: nothing more will come.
            None => std::future::pending().await,
        }
    }

    fn local_addr(&self) -> std::io::Result<Self::Addr> {
        Ok(self.0.local_addr())
    }
}

pub fn router(reg: Arc<Registry>) -> Router {
    Router::new()
        .route("/v1/models", get(models))
        .route("/v1/embeddings", post(embeddings))
        .route("/v1/completions", post(completions))
        .route("/v1/chat/completions", post(chat))
        .with_state(reg)
}

struct ApiError(StatusCode, String, &'static str);

impl From<ModelError> for ApiError {
    fn from(e: ModelError) -> Self {
        let (code, kind) = match &e {
            ModelError::InvalidArgument(_) => (StatusCode::BAD_REQUEST, "invalid_request_error"),
            ModelError::UnknownModel(_) => (StatusCode::NOT_FOUND, "model_not_found"),
            ModelError::Overloaded(_) | ModelError::Backlog { .. } => {
                (StatusCode::TOO_MANY_REQUESTS, "rate_limit_exceeded")
            }
            ModelError::Unavailable(_) => (StatusCode::SERVICE_UNAVAILABLE, "server_error"),
            ModelError::Load { .. } | ModelError::Inference(_) => {
                (StatusCode::INTERNAL_SERVER_ERROR, "server_error")
            }
        };
        ApiError(code, e.to_string(), kind)
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let body = json!({"error": {"message": self.1, "type": self.2, "code": self.0.as_u16()}});
        let mut r = (self.0, Json(body)).into_response();
        if self.0 == StatusCode::TOO_MANY_REQUESTS || self.0 == StatusCode::SERVICE_UNAVAILABLE {
            r.headers_mut()
                .insert(header::RETRY_AFTER, header::HeaderValue::from_static("1"));
        }
        r
    }
}

fn bad(msg: impl Into<String>) -> ApiError {
    ApiError(StatusCode::BAD_REQUEST, msg.into(), "invalid_request_error")
}

async fn models(State(reg): State<Arc<Registry>>) -> Json<Value> {
    let data: Vec<Value> = reg
        .models()
        .into_iter()
        .map(|m| json!({"id": m.name, "object": "model", "owned_by": "ragcluster", "kind": m.kind}))
        .collect();
    Json(json!({"object": "list", "data": data}))
}

async fn embeddings(
    State(reg): State<Arc<Registry>>,
    Json(v): Json<Value>,
) -> Result<Json<Value>, ApiError> {
    let texts: Vec<String> = match &v["input"] {
        Value::String(s) => vec![s.clone()],
        Value::Array(a) => a
            .iter()
            .map(|x| x.as_str().map(str::to_owned))
            .collect::<Option<_>>()
            .ok_or_else(|| bad("input must be a string or a list of strings"))?,
        _ => return Err(bad("input must be a string or a list of strings")),
    };
    // Cohere's and Voyage's `input_type` ("query" / "document"): which task prefix the model
    // gets; OpenAI's API has no such field, so it is optional.
    let input = match v["input_type"].as_str() {
        None | Some("document") => EmbedInput::Document,
        Some("query") => EmbedInput::Query,
        Some(other) => {
            return Err(bad(format!(
                "input_type must be \"query\" or \"document\", not {other:?}"
            )));
        }
    };
    let out = reg
        .embed(v["model"].as_str().unwrap_or_default(), texts, input, None)
        .await?;
    let data: Vec<Value> = out
        .vectors
        .into_iter()
        .enumerate()
        .map(|(i, e)| json!({"object": "embedding", "index": i, "embedding": e}))
        .collect();
    Ok(Json(json!({
        "object": "list",
        "data": data,
        "model": out.model,
        "usage": {"prompt_tokens": out.tokens, "total_tokens": out.tokens},
    })))
}

/// Sampling fields shared by both completion routes, with OpenAI's defaults (temperature 1).
fn sampling(v: &Value, r: &mut GenerateRequest) -> Result<(), ApiError> {
    r.model = v["model"].as_str().unwrap_or_default().to_owned();
    let num = |k: &str, d: f64| -> Result<f64, ApiError> {
        match &v[k] {
            Value::Null => Ok(d),
            x => x
                .as_f64()
                .ok_or_else(|| bad(format!("{k} must be a number"))),
        }
    };
    let max = num("max_completion_tokens", num("max_tokens", 0.0)?)?;
    if max < 0.0 || max.fract() != 0.0 || max > f64::from(u32::MAX) {
        return Err(bad("max_tokens must be a positive integer"));
    }
    r.max_tokens = max as u32;
    r.temperature = num("temperature", 1.0)? as f32;
    r.top_p = num("top_p", 1.0)? as f32;
    r.seed = num("seed", 0.0)?.max(0.0) as u64;
    r.stop = match &v["stop"] {
        Value::Null => Vec::new(),
        Value::String(s) => vec![s.clone()],
        Value::Array(a) => a
            .iter()
            .map(|x| x.as_str().map(str::to_owned))
            .collect::<Option<_>>()
            .ok_or_else(|| bad("stop must be a string or a list of strings"))?,
        _ => return Err(bad("stop must be a string or a list of strings")),
    };
    Ok(())
}

async fn completions(
    State(reg): State<Arc<Registry>>,
    Json(v): Json<Value>,
) -> Result<Response, ApiError> {
    let mut r = GenerateRequest {
        raw: true,
        ..Default::default()
    };
    sampling(&v, &mut r)?;
    r.prompt = match &v["prompt"] {
        Value::String(s) => s.clone(),
        _ => return Err(bad("prompt must be a string")),
    };
    let logprobs = !v["logprobs"].is_null() && v["logprobs"] != json!(false);
    respond(
        &reg,
        r,
        v["stream"].as_bool().unwrap_or(false),
        logprobs,
        false,
    )
    .await
}

async fn chat(
    State(reg): State<Arc<Registry>>,
    Json(v): Json<Value>,
) -> Result<Response, ApiError> {
    let mut r = GenerateRequest::default();
    sampling(&v, &mut r)?;
    let msgs = v["messages"]
        .as_array()
        .ok_or_else(|| bad("messages must be a list"))?;
    let mut turns = Vec::new();
    let mut system = Vec::new();
    for (i, m) in msgs.iter().enumerate() {
        let content = match &m["content"] {
            Value::String(s) => s.clone(),
            // Content parts: the text parts, concatenated.
            Value::Array(parts) => parts
                .iter()
                .filter_map(|p| p["text"].as_str())
                .collect::<Vec<_>>()
                .join(""),
            _ => return Err(bad(format!("messages[{i}].content must be text"))),
        };
        match m["role"].as_str() {
            Some("system" | "developer") => system.push(content),
            Some(role @ ("user" | "assistant")) => turns.push(ChatMessage {
                role: role.to_owned(),
                content,
            }),
            _ => return Err(bad(format!("messages[{i}].role is not supported"))),
        }
    }
    // vLLM's `continue_final_message`: a final assistant message is a prefix to continue.
    if v["continue_final_message"].as_bool().unwrap_or(false)
        && turns.last().is_some_and(|m| m.role == "assistant")
    {
        r.assistant_prefix = turns.pop().map(|m| m.content).unwrap_or_default();
    }
    let last = turns
        .pop()
        .filter(|m| m.role == "user")
        .ok_or_else(|| bad("the last message must be from the user"))?;
    r.prompt = last.content;
    r.history = turns;
    r.system = system.join("\n");
    let logprobs = v["logprobs"].as_bool().unwrap_or(false);
    respond(
        &reg,
        r,
        v["stream"].as_bool().unwrap_or(false),
        logprobs,
        true,
    )
    .await
}

fn now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

/// One OpenAI choice object for a piece of output.
/// A generation's `usage` object, with OpenAI's `prompt_tokens_details.cached_tokens`.
fn usage(m: &GenerateResponse) -> Value {
    json!({"prompt_tokens": m.prompt_tokens,
           "completion_tokens": m.completion_tokens,
           "total_tokens": m.prompt_tokens + m.completion_tokens,
           "prompt_tokens_details": {"cached_tokens": m.cached_tokens}})
}

fn choice(chat: bool, stream: bool, m: &GenerateResponse, logprobs: bool) -> Value {
    let finish = if m.finished {
        json!(m.finish_reason)
    } else {
        Value::Null
    };
    let mut c = if chat {
        let key = if stream { "delta" } else { "message" };
        json!({"index": 0, key: {"role": "assistant", "content": m.text}, "finish_reason": finish})
    } else {
        json!({"index": 0, "text": m.text, "finish_reason": finish})
    };
    if logprobs {
        c["logprobs"] = if chat {
            json!({"content": [{"token": m.text, "logprob": m.logprob}]})
        } else {
            json!({"tokens": [m.text], "token_logprobs": [m.logprob]})
        };
    }
    c
}

async fn respond(
    reg: &Registry,
    r: GenerateRequest,
    stream: bool,
    logprobs: bool,
    chat: bool,
) -> Result<Response, ApiError> {
    let model = r.model.clone();
    let mut rx = reg.generate(r).await?;
    let id = format!("cmpl-{:x}", now() ^ u64::from(std::process::id()));
    let object = match (chat, stream) {
        (true, true) => "chat.completion.chunk",
        (true, false) => "chat.completion",
        _ => "text_completion",
    };
    if !stream {
        let mut text = String::new();
        let mut lps = Vec::new();
        let mut last = GenerateResponse::default();
        while let Some(m) = rx.recv().await {
            let m = m?;
            text.push_str(&m.text);
            lps.push((m.text.clone(), m.logprob));
            if m.finished {
                last = m;
                break;
            }
        }
        let mut c = choice(
            chat,
            false,
            &GenerateResponse {
                text,
                ..last.clone()
            },
            false,
        );
        if logprobs {
            c["logprobs"] = if chat {
                json!({"content": lps.iter().map(|(t, l)| json!({"token": t, "logprob": l})).collect::<Vec<_>>()})
            } else {
                json!({"tokens": lps.iter().map(|(t, _)| t).collect::<Vec<_>>(),
                       "token_logprobs": lps.iter().map(|(_, l)| l).collect::<Vec<_>>()})
            };
        }
        return Ok(Json(json!({
            "id": id, "object": object, "created": now(), "model": model,
            "choices": [c],
            "usage": usage(&last),
        }))
        .into_response());
    }
    // Server-sent events; the body stream ends (and the generation is cancelled) when the
    // client disconnects, since dropping `rx` closes the channel.
    let (tx, body_rx) = mpsc::channel::<Result<bytes::Bytes, std::io::Error>>(64);
    tokio::spawn(async move {
        let event = |v: Value| bytes::Bytes::from(format!("data: {v}\n\n"));
        while let Some(m) = rx.recv().await {
            let m = match m {
                Ok(m) => m,
                Err(e) => {
                    let ApiError(code, msg, kind) = e.into();
                    let v = json!({"error": {"message": msg, "type": kind, "code": code.as_u16()}});
                    let _ = tx.send(Ok(event(v))).await;
                    break;
                }
            };
            let mut chunk = json!({"id": id, "object": object, "created": now(), "model": model,
                                   "choices": [choice(chat, true, &m, logprobs)]});
            if m.finished {
                chunk["usage"] = usage(&m);
            }
            if tx.send(Ok(event(chunk))).await.is_err() {
                return;
            }
            if m.finished {
                break;
            }
        }
        let _ = tx
            .send(Ok(bytes::Bytes::from_static(b"data: [DONE]\n\n")))
            .await;
    });
    let body = Body::from_stream(tokio_stream::wrappers::ReceiverStream::new(body_rx));
    Ok(Response::builder()
        .header(header::CONTENT_TYPE, "text/event-stream")
        .header(header::CACHE_CONTROL, "no-cache")
        .body(body)
        .unwrap_or_else(|_| StatusCode::INTERNAL_SERVER_ERROR.into_response()))
}
