//! BEIR-format datasets: `corpus.jsonl` (`_id`, `title`, `text`), `queries.jsonl` (`_id`,
//! `text`) and `qrels/{split}.tsv` (query-id, corpus-id, score, with a header line).

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use serde::Deserialize;

use super::metrics::Rels;

#[derive(Debug, thiserror::Error)]
pub enum BeirError {
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{path}:{line}: {reason}")]
    Format {
        path: PathBuf,
        line: usize,
        reason: String,
    },
}

#[derive(Debug, Clone, Deserialize)]
pub struct BeirDoc {
    #[serde(rename = "_id")]
    pub id: String,
    #[serde(default)]
    pub title: String,
    pub text: String,
}

#[derive(Debug, Clone, Deserialize)]
pub struct BeirQuery {
    #[serde(rename = "_id")]
    pub id: String,
    pub text: String,
}

fn read(path: &Path) -> Result<String, BeirError> {
    std::fs::read_to_string(path).map_err(|source| BeirError::Io {
        path: path.to_owned(),
        source,
    })
}

/// The first `limit` JSON lines of a file (blank lines skipped).
pub fn read_jsonl<T: serde::de::DeserializeOwned>(
    path: &Path,
    limit: usize,
) -> Result<Vec<T>, BeirError> {
    read(path)?
        .lines()
        .enumerate()
        .filter(|(_, l)| !l.trim().is_empty())
        .take(limit)
        .map(|(i, l)| {
            serde_json::from_str(l).map_err(|e| BeirError::Format {
                path: path.to_owned(),
                line: i + 1,
                reason: e.to_string(),
            })
        })
        .collect()
}

/// Query id -> graded relevant documents.
pub fn read_qrels(path: &Path) -> Result<HashMap<String, Rels>, BeirError> {
    let mut out: HashMap<String, Rels> = HashMap::new();
    for (i, line) in read(path)?.lines().enumerate() {
        let f: Vec<&str> = line.split('\t').collect();
        if line.trim().is_empty()
            || (i == 0 && f.get(2).is_some_and(|s| s.trim().parse::<i64>().is_err()))
        {
            continue; // the header
        }
        if f.len() < 3 {
            return Err(BeirError::Format {
                path: path.to_owned(),
                line: i + 1,
                reason: "expected query-id<TAB>corpus-id<TAB>score".into(),
            });
        }
        let grade: i64 = f[2].trim().parse().map_err(|_| BeirError::Format {
            path: path.to_owned(),
            line: i + 1,
            reason: format!("score {:?} is not an integer", f[2]),
        })?;
        out.entry(f[0].to_owned())
            .or_default()
            .insert(f[1].to_owned(), grade.max(0) as u32);
    }
    Ok(out)
}

/// A dataset directory's queries that have judgements in `split`, with those judgements.
pub struct Judged {
    pub queries: Vec<BeirQuery>,
    pub qrels: HashMap<String, Rels>,
}

pub fn judged_queries(dir: &Path, split: &str, limit: usize) -> Result<Judged, BeirError> {
    let qrels = read_qrels(&dir.join("qrels").join(format!("{split}.tsv")))?;
    let queries: Vec<BeirQuery> = read_jsonl::<BeirQuery>(&dir.join("queries.jsonl"), usize::MAX)?
        .into_iter()
        .filter(|q| qrels.contains_key(&q.id))
        .take(limit)
        .collect();
    Ok(Judged { queries, qrels })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_a_dataset() {
        let d = tempfile_dir();
        std::fs::create_dir_all(d.join("qrels")).unwrap();
        std::fs::write(
            d.join("queries.jsonl"),
            "{\"_id\":\"1\",\"text\":\"q one\"}\n{\"_id\":\"2\",\"text\":\"q two\"}\n",
        )
        .unwrap();
        std::fs::write(
            d.join("qrels/test.tsv"),
            "query-id\tcorpus-id\tscore\n1\td1\t1\n1\td2\t2\n",
        )
        .unwrap();
        let j = judged_queries(&d, "test", 10).unwrap();
        assert_eq!(j.queries.len(), 1);
        assert_eq!(j.qrels["1"]["d2"], 2);
        std::fs::write(d.join("qrels/bad.tsv"), "1\td1\n").unwrap();
        assert!(
            read_qrels(&d.join("qrels/bad.tsv"))
                .unwrap_err()
                .to_string()
                .contains("bad.tsv:1")
        );
        std::fs::remove_dir_all(&d).unwrap();
    }

    fn tempfile_dir() -> PathBuf {
        let d = std::env::temp_dir().join(format!("beir-test-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        d
    }
}
