//! `ragctl collection reembed ACTION NAME`: moves a collection to another embedding model
//! while it serves (`Admin.Reembed`); the copy runs on the coordinators, this command
//! follows its progress.

use std::time::Instant;

use anyhow::{Result, bail};
use clap::{Args, ValueEnum};
use ragcluster_proto::v1::admin_client::AdminClient;
use ragcluster_proto::v1::*;

use crate::{Cli, channel};

#[derive(Clone, Copy, ValueEnum)]
pub enum Action {
    /// Create the new collection and copy every document into it (resumes a stopped copy).
    Start,
    /// Copy again what changed (writes go to both meanwhile).
    Sync,
    /// Sync, then move every alias of the collection to the new one in one step.
    Switch,
    /// Move the aliases back to the old collection.
    Rollback,
    /// After a switch: drop the old collection and end the re-embedding.
    Finish,
    /// Before a switch: drop the new collection and end the re-embedding.
    Cancel,
    /// Show the job and how many documents each collection holds.
    Status,
}

#[derive(Args)]
pub struct ReembedArgs {
    /// What to do.
    #[arg(value_enum)]
    action: Action,
    /// The collection, or an alias naming it.
    name: String,
    /// start: the new embedding model (a model the worker serves).
    #[arg(long, default_value = "")]
    embedding_model: String,
    /// start: the new collection's name (default NAME-MODEL).
    #[arg(long, default_value = "")]
    target: String,
    /// Copy batches (64 documents each) in flight per shard, 1 to 16.
    #[arg(long, default_value_t = 2)]
    parallel: u32,
    /// Print each progress message as a JSON line.
    #[arg(long)]
    json: bool,
}

pub async fn run(cli: &Cli, a: &ReembedArgs) -> Result<()> {
    let action = match a.action {
        Action::Start => ReembedAction::Start,
        Action::Sync => ReembedAction::Sync,
        Action::Switch => ReembedAction::Switch,
        Action::Rollback => ReembedAction::Rollback,
        Action::Finish => ReembedAction::Finish,
        Action::Cancel => ReembedAction::Cancel,
        Action::Status => ReembedAction::Status,
    };
    let req = ReembedRequest {
        collection: a.name.clone(),
        action: action as i32,
        embedding_model: a.embedding_model.clone(),
        target: a.target.clone(),
        parallel: a.parallel,
    };
    let started = Instant::now();
    let mut stream = AdminClient::new(channel(cli).await?)
        .reembed(req)
        .await?
        .into_inner();
    while let Some(p) = stream.message().await? {
        if a.json {
            println!("{}", json(&p, started.elapsed().as_secs_f64()));
        } else {
            print(&p, started.elapsed().as_secs_f64());
        }
        if p.done {
            return Ok(());
        }
    }
    bail!("the coordinator ended the stream before the step was done")
}

fn json(p: &ReembedProgress, secs: f64) -> serde_json::Value {
    let job = p.job.as_ref();
    serde_json::json!({
        "phase": p.phase, "source": p.source, "target": p.target,
        "embedding_model": job.map(|j| j.embedding_model.clone()),
        "switched": job.map(|j| j.switched), "epoch": job.map(|j| j.epoch),
        "documents_copied": p.documents_copied, "documents_total": p.documents_total,
        "chunks_embedded": p.chunks_embedded, "chunks_reused": p.chunks_reused,
        "documents_newer": p.documents_newer, "documents_deleted": p.documents_deleted,
        "done": p.done, "message": p.message, "seconds": secs,
    })
}

fn print(p: &ReembedProgress, secs: f64) {
    let state = match &p.job {
        Some(j) if j.switched => format!("switched to {} ({})", p.target, j.embedding_model),
        Some(j) => format!(
            "serving {}, copying to {} ({})",
            p.source, p.target, j.embedding_model
        ),
        None => "no re-embedding".into(),
    };
    if p.phase == "status" || p.phase == "rollback" || p.phase == "finish" || p.phase == "cancel" {
        println!("{state}: {}", p.message);
        return;
    }
    println!(
        "[{secs:7.1} s] {}: {}/{} documents, {} chunks embedded, {} reused, {} newer in the \
         target, {} deleted{}",
        p.phase,
        p.documents_copied,
        p.documents_total,
        p.chunks_embedded,
        p.chunks_reused,
        p.documents_newer,
        p.documents_deleted,
        if p.message.is_empty() {
            String::new()
        } else {
            format!(" ({})", p.message)
        }
    );
    if p.done {
        println!("{state}");
    }
}
