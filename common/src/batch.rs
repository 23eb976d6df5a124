//! Draining a queue into batches for a long-lived stream: each message a stream sends carries
//! everything queued when it was polled, so under load many calls share one message (one
//! HTTP/2 frame, one write) and an idle stream still sends each call at once.

use std::task::Poll;

use futures::Stream;
use tokio::sync::mpsc::UnboundedReceiver;

/// The items of `rx` in batches of 1..=`max`, in order; ends when every sender is gone and the
/// queue is empty.
pub fn batches<T>(mut rx: UnboundedReceiver<T>, max: usize) -> impl Stream<Item = Vec<T>> {
    let max = max.max(1);
    futures::stream::poll_fn(move |cx| match rx.poll_recv(cx) {
        Poll::Ready(Some(first)) => {
            let mut batch = Vec::with_capacity(rx.len().min(max - 1) + 1);
            batch.push(first);
            while batch.len() < max {
                match rx.try_recv() {
                    Ok(t) => batch.push(t),
                    Err(_) => break,
                }
            }
            Poll::Ready(Some(batch))
        }
        Poll::Ready(None) => Poll::Ready(None),
        Poll::Pending => Poll::Pending,
    })
}

#[cfg(test)]
mod tests {
    use futures::StreamExt;

    use super::*;

    #[tokio::test]
    async fn queued_items_share_a_batch_up_to_max() {
        let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
        for i in 0..5 {
            tx.send(i).unwrap();
        }
        let mut s = Box::pin(batches(rx, 3));
        assert_eq!(s.next().await, Some(vec![0, 1, 2]));
        assert_eq!(s.next().await, Some(vec![3, 4]));
        tx.send(5).unwrap();
        assert_eq!(s.next().await, Some(vec![5]));
        drop(tx);
        assert_eq!(s.next().await, None);
    }
}
