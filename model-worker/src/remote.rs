//! Generation forwarded to an OpenAI-compatible HTTP server (vLLM, llama.cpp's server, TGI's
//! OpenAI route, or another ragcluster model worker's `http_listen`): many operators already
//! run one, and the cluster then only needs this worker as its gRPC front.
//!
//! Chat requests go to `{endpoint}/chat/completions`, `raw` prompts to
//! `{endpoint}/completions`, always streamed (`stream: true`) with log-probabilities, so the
//! gRPC stream keeps its per-token shape. Dropping the gRPC stream closes the HTTP connection,
//! which stops the remote generation.

use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use ragcluster_proto::v1::{GenerateRequest, GenerateResponse};
use serde_json::{Value, json};
use tokio::sync::mpsc;

use crate::backend::decoder::llama::GenParams;
use crate::config::ModelSpec;
use crate::error::ModelError;

/// Longest silence between two streamed chunks before the call is abandoned.
const IDLE_TIMEOUT: Duration = Duration::from_secs(60);

pub struct RemoteGenerator {
    name: String,
    base: String,
    model: String,
    api_key: Option<String>,
    client: Client<HttpConnector, Full<Bytes>>,
}

impl RemoteGenerator {
    pub fn new(spec: &ModelSpec) -> Result<Self, ModelError> {
        let api_key = if spec.api_key_env.is_empty() {
            None
        } else {
            Some(
                std::env::var(&spec.api_key_env).map_err(|_| ModelError::Load {
                    name: spec.name.clone(),
                    path: spec.endpoint.clone(),
                    reason: format!("environment variable {} is not set", spec.api_key_env),
                })?,
            )
        };
        let mut conn = HttpConnector::new();
        conn.set_connect_timeout(Some(Duration::from_secs(5)));
        conn.set_nodelay(true);
        Ok(Self {
            name: spec.name.clone(),
            base: spec.endpoint.trim_end_matches('/').to_owned(),
            model: if spec.remote_model.is_empty() {
                spec.name.clone()
            } else {
                spec.remote_model.clone()
            },
            api_key,
            client: Client::builder(TokioExecutor::new()).build(conn),
        })
    }

    /// Streams the remote generation into `tx`; errors are sent as the stream's last item.
    pub async fn generate(
        &self,
        r: GenerateRequest,
        p: GenParams,
        tx: mpsc::Sender<Result<GenerateResponse, ModelError>>,
    ) {
        if let Err(e) = self.forward(&r, &p, &tx).await {
            tracing::warn!(model = %self.name, error = %e, "remote generation failed");
            let _ = tx.send(Err(e)).await;
        }
    }

    fn body(&self, r: &GenerateRequest, p: &GenParams) -> (String, Value) {
        let mut body = json!({
            "model": self.model,
            "max_tokens": p.max_tokens,
            "temperature": p.temperature,
            "top_p": p.top_p,
            "seed": p.seed,
            "stream": true,
            "stream_options": {"include_usage": true},
        });
        if !p.stop.is_empty() {
            body["stop"] = json!(p.stop);
        }
        if r.raw {
            body["prompt"] = json!(format!("{}{}", r.prompt, r.assistant_prefix));
            body["logprobs"] = json!(1);
            (format!("{}/completions", self.base), body)
        } else {
            let mut messages = Vec::new();
            if !r.system.is_empty() {
                messages.push(json!({"role": "system", "content": r.system}));
            }
            for m in &r.history {
                messages.push(json!({"role": m.role, "content": m.content}));
            }
            messages.push(json!({"role": "user", "content": r.prompt}));
            if !r.assistant_prefix.is_empty() {
                // vLLM's extension for continuing a partial assistant message.
                messages.push(json!({"role": "assistant", "content": r.assistant_prefix}));
                body["continue_final_message"] = json!(true);
                body["add_generation_prompt"] = json!(false);
            }
            body["messages"] = Value::Array(messages);
            body["logprobs"] = json!(true);
            (format!("{}/chat/completions", self.base), body)
        }
    }

    /// Sends the request; a non-2xx answer becomes the matching error.
    async fn open(
        &self,
        r: &GenerateRequest,
        p: &GenParams,
    ) -> Result<(String, hyper::body::Incoming), ModelError> {
        let (url, body) = self.body(r, p);
        let mut req = hyper::Request::post(&url)
            .header("content-type", "application/json")
            .header("accept", "text/event-stream");
        if let Some(k) = &self.api_key {
            req = req.header("authorization", format!("Bearer {k}"));
        }
        let req = req
            .body(Full::new(Bytes::from(body.to_string())))
            .map_err(|e| ModelError::InvalidArgument(format!("endpoint {url}: {e}")))?;
        let resp = tokio::time::timeout(IDLE_TIMEOUT, self.client.request(req))
            .await
            .map_err(|_| ModelError::Unavailable(format!("{url}: no answer in 60 s")))?
            .map_err(|e| ModelError::Unavailable(format!("{url}: {e}")))?;
        let status = resp.status();
        let body = resp.into_body();
        if status.is_success() {
            return Ok((url, body));
        }
        let bytes = tokio::time::timeout(IDLE_TIMEOUT, body.collect())
            .await
            .ok()
            .and_then(|b| b.ok())
            .map(|b| b.to_bytes())
            .unwrap_or_default();
        let msg = serde_json::from_slice::<Value>(&bytes)
            .ok()
            .and_then(|v| v["error"]["message"].as_str().map(str::to_owned))
            .unwrap_or_else(|| String::from_utf8_lossy(&bytes).into_owned());
        let msg = format!("{url}: HTTP {}: {msg}", status.as_u16());
        Err(match status.as_u16() {
            400 | 422 => ModelError::InvalidArgument(msg),
            404 => ModelError::UnknownModel(msg),
            429 => ModelError::Overloaded(msg),
            _ => ModelError::Unavailable(msg),
        })
    }

    /// Streams the server's tokens to `tx`, the last one marked `finished` with the usage.
    async fn forward(
        &self,
        r: &GenerateRequest,
        p: &GenParams,
        tx: &mpsc::Sender<Result<GenerateResponse, ModelError>>,
    ) -> Result<(), ModelError> {
        let (url, mut body) = self.open(r, p).await?;
        let mut buf: Vec<u8> = Vec::new();
        let mut pending: Option<GenerateResponse> = None;
        let mut last = GenerateResponse::default();
        let mut sent_tokens = 0u32;
        let mut done = false;
        while !done {
            let frame = tokio::select! {
                f = tokio::time::timeout(IDLE_TIMEOUT, body.frame()) => f,
                _ = tx.closed() => return Ok(()),
            };
            let frame = match frame {
                Err(_) => return Err(ModelError::Unavailable(format!("{url}: stream stalled"))),
                Ok(None) => break,
                Ok(Some(Err(e))) => return Err(ModelError::Unavailable(format!("{url}: {e}"))),
                Ok(Some(Ok(f))) => f,
            };
            let Ok(data) = frame.into_data() else {
                continue;
            };
            buf.extend_from_slice(&data);
            // Server-sent events: one JSON object per "data:" line.
            while let Some(nl) = buf.iter().position(|&b| b == b'\n') {
                let line: Vec<u8> = buf.drain(..=nl).collect();
                let line = String::from_utf8_lossy(&line);
                let Some(payload) = line.trim().strip_prefix("data:") else {
                    continue;
                };
                let payload = payload.trim();
                if payload == "[DONE]" {
                    done = true;
                    break;
                }
                let Some(next) = chunk(&url, payload, &mut last)? else {
                    continue;
                };
                sent_tokens += 1;
                // Held one message back so the last can carry `finished`.
                if let Some(m) = pending.replace(next)
                    && tx.send(Ok(m)).await.is_err()
                {
                    return Ok(());
                }
            }
        }
        let mut end = pending.unwrap_or_default();
        end.finished = true;
        end.finish_reason = match last.finish_reason.as_str() {
            "" => "stop".into(),
            f => f.to_owned(),
        };
        end.prompt_tokens = last.prompt_tokens;
        end.cached_tokens = last.cached_tokens;
        end.completion_tokens = if last.completion_tokens > 0 {
            last.completion_tokens
        } else {
            sent_tokens
        };
        metrics::counter!("model_generated_tokens_total", "model" => self.name.clone())
            .increment(u64::from(end.completion_tokens));
        let _ = tx.send(Ok(end)).await;
        Ok(())
    }
}

/// One server-sent chunk: its token, if it carries one; usage and finish reason go to `last`.
fn chunk(
    url: &str,
    payload: &str,
    last: &mut GenerateResponse,
) -> Result<Option<GenerateResponse>, ModelError> {
    let v: Value = serde_json::from_str(payload)
        .map_err(|e| ModelError::Unavailable(format!("{url}: bad stream chunk: {e}")))?;
    if let Some(err) = v.get("error") {
        return Err(ModelError::Unavailable(format!("{url}: {err}")));
    }
    if let Some(u) = v.get("usage").filter(|u| !u.is_null()) {
        last.prompt_tokens = u["prompt_tokens"].as_u64().unwrap_or(0) as u32;
        last.completion_tokens = u["completion_tokens"].as_u64().unwrap_or(0) as u32;
        // OpenAI's and vLLM's name for prompt tokens served from a prefix cache.
        last.cached_tokens = u["prompt_tokens_details"]["cached_tokens"]
            .as_u64()
            .unwrap_or(0) as u32;
    }
    let Some(c) = v["choices"].get(0) else {
        return Ok(None);
    };
    if let Some(f) = c["finish_reason"].as_str() {
        last.finish_reason = f.to_owned();
    }
    let text = c["delta"]["content"]
        .as_str()
        .or_else(|| c["text"].as_str())
        .unwrap_or_default();
    let logprob = c["logprobs"]["content"][0]["logprob"]
        .as_f64()
        .or_else(|| c["logprobs"]["token_logprobs"][0].as_f64());
    if text.is_empty() && logprob.is_none() {
        return Ok(None);
    }
    Ok(Some(GenerateResponse {
        text: text.to_owned(),
        logprob: logprob.unwrap_or(0.0) as f32,
        ..Default::default()
    }))
}
